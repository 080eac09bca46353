"""Which parsers a server uses when none is named: read from the chat template, and only when
it is unambiguous (the template writes exactly one family's markers). vLLM makes the user name
them; a template names its family as surely, and the choice is logged, so a wrong guess is
visible and a flag overrides it.
"""

from __future__ import annotations

import logging

from conveyor.entrypoints.parsers import ParserNames

logger = logging.getLogger(__name__)

# Marker(s) a template writes -> the parser of its family; the more specific ones first (a
# Qwen3-Coder template writes <tool_call> too, a DeepSeek-R1 one <think> too).
_REASONING_SIGNS: list[tuple[tuple[str, ...], str]] = [
    (("<|channel|>", "<|message|>"), "openai_gptoss"),
    (("<|channel>", "<channel|>"), "gemma4"),
    (("<think>", "<｜Assistant｜>"), "deepseek_r1"),
    (("<think>", "<|im_start|>"), "qwen3"),
    (("[THINK]",), "mistral"),
    (("<think>",), "think"),
]
_TOOL_SIGNS: list[tuple[tuple[str, ...], str]] = [
    (("<|channel|>", "to=functions"), "openai"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<tool_call>", "<function="), "qwen3_coder"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v3"),
    (("<|python_start|>",), "llama4_pythonic"),
    (("<|python_tag|>",), "llama3_json"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|tool_call|>",), "granite"),
    (("<tool_call>",), "hermes"),
]


def chosen(names: ParserNames, template: str | None) -> ParserNames:
    """names with each parser not named filled in from the template, when it is unambiguous."""
    reasoning, tool_call = names.reasoning, names.tool_call
    if reasoning is None:
        reasoning = _sign(template or "", _REASONING_SIGNS, "reasoning")
    if tool_call is None:
        tool_call = _sign(template or "", _TOOL_SIGNS, "tool-call")
    return ParserNames(reasoning, tool_call, names.auto_tool_choice)


def _sign(template: str, signs: list[tuple[tuple[str, ...], str]], kind: str) -> str | None:
    """The first family whose markers the template writes; None if two unrelated families
    match (a template that writes both <think> and [THINK] is no one's)."""
    found = [name for markers, name in signs if all(m in template for m in markers)]
    if not found:
        return None
    first = found[0]
    related = {first} | _FAMILY.get(first, set())
    if any(name not in related for name in found[1:]):
        logger.info("%s parser: the chat template matches %s; none chosen", kind, found)
        return None
    logger.info("%s parser: %s, chosen from the chat template", kind, first)
    return first


# Parsers whose markers contain another's: matching both is no ambiguity.
_FAMILY = {
    "deepseek_r1": {"think"},
    "qwen3": {"think"},
    "qwen3_coder": {"hermes"},
    "openai_gptoss": set(),
}
