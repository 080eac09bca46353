"""Reasoning parsers: they split a reply into its reasoning and its answer (content).

Each is a small state machine fed the reply's text piece by piece (`feed`, then `finish`), so
the whole reply and its stream are parsed by the same code: the pieces of one text are the
same whatever its cuts. `reasoning_parser(name, ...)` makes one for a request.
"""

from __future__ import annotations

from conveyor.entrypoints.parsers.reasoning.gemma4 import Gemma4Reasoning
from conveyor.entrypoints.parsers.reasoning.harmony import HarmonyReasoning
from conveyor.entrypoints.parsers.reasoning.markers import (
    GRANITE,
    MISTRAL,
    THINK,
    MarkedReasoning,
    Markers,
)

ReasoningParser = MarkedReasoning | HarmonyReasoning | Gemma4Reasoning


def reasoning_parser(
    name: str, prompt_opens_reasoning: bool = False, template_kwargs: dict | None = None
) -> ReasoningParser | None:
    """A fresh parser for one reply. prompt_opens_reasoning: the prompt ends inside an open
    reasoning block (a template that writes `<think>` itself), so the reply starts in it.
    None: this request has no reasoning to parse (deepseek_v3 without thinking on)."""
    kwargs = template_kwargs or {}
    if name == "openai_gptoss":
        return HarmonyReasoning()
    if name == "gemma4":
        return Gemma4Reasoning(prompt_opens_reasoning)
    if name == "deepseek_v3" and not (kwargs.get("thinking") or kwargs.get("enable_thinking")):
        return None
    markers: Markers = {"granite": GRANITE, "mistral": MISTRAL}.get(name, THINK)
    implicit = name in ("deepseek_r1", "deepseek_v3") or prompt_opens_reasoning
    return MarkedReasoning(markers, implicit)
