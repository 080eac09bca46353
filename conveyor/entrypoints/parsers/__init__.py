"""Reasoning and tool-call parsers, by vLLM's names.

A model family writes its reasoning and its tool calls in its own syntax (`<think>` blocks,
`[TOOL_CALLS]`, harmony channels, ...); a parser turns that raw text into typed pieces. The
names are vLLM's, so that a model card's `vllm serve ... --reasoning-parser qwen3
--tool-call-parser hermes` line works as written. This module imports nothing heavy (no torch,
no parser modules): the command line reads the names before anything loads.

Streamed calls follow vLLM's policy (tools/stream.py): a call is committed once its name is
read, then its arguments stream as deltas that join to exactly its final `arguments`; a
committed call whose arguments then fail to parse still ends as that call, with the raw text
written, because a streamed call cannot be taken back (and a whole answer reads the same).
"""

from __future__ import annotations

REASONING_PARSERS: tuple[str, ...] = (
    "deepseek_r1",
    "deepseek_v3",
    "gemma4",
    "granite",
    "mistral",
    "openai_gptoss",
    "qwen3",
    "think",
)
TOOL_CALL_PARSERS: tuple[str, ...] = (
    "deepseek_v3",
    "gemma4",
    "granite",
    "hermes",
    "llama3_json",
    "llama4_pythonic",
    "mistral",
    "openai",
    "pythonic",
    "qwen3_coder",
    "qwen3_xml",
)


# The marker texts each parser reads, an entry per name above (a name without one failed every
# request with a 500). A family's tokenizer may make them special tokens, which the
# detokenizer's skip_special_tokens removes before a parser could see them.
_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")
_HARMONY += ("<|return|>",)
_THINK = ("<think>", "</think>")
REASONING_MARKERS: dict[str, tuple[str, ...]] = {
    "deepseek_r1": _THINK,
    "deepseek_v3": _THINK,
    "gemma4": ("<|channel>", "<channel|>", "<|tool_call>"),
    "granite": (),
    "mistral": ("[THINK]", "[/THINK]"),
    "openai_gptoss": _HARMONY,
    "qwen3": _THINK,
    "think": _THINK,
}
_DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")
_DEEPSEEK_CALLS += ("<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
TOOL_MARKERS: dict[str, tuple[str, ...]] = {
    "deepseek_v3": _DEEPSEEK_CALLS,
    "gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>'),
    "granite": ("<|tool_call|>", "<tool_call>", "</tool_call>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "llama4_pythonic": ("<|python_start|>", "<|python_end|>"),
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "openai": _HARMONY,
    "pythonic": (),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "qwen3_xml": ("<tool_call>", "</tool_call>"),
}


def check_name(kind: str, name: str | None, names: tuple[str, ...]) -> str | None:
    """name itself when it is one of names (or None); else a ValueError listing the valid ones."""
    if name is None or name in names:
        return name
    raise ValueError(f"--{kind}: unknown parser {name!r}; valid names: {', '.join(names)}")


class ParserNames:
    """The parsers a server was started with: None lets the chat template choose (when it is
    unambiguous; parsers/select.py)."""

    __slots__ = ("reasoning", "tool_call", "auto_tool_choice")

    def __init__(
        self,
        reasoning: str | None = None,
        tool_call: str | None = None,
        auto_tool_choice: bool = False,
    ) -> None:
        self.reasoning = check_name("reasoning-parser", reasoning, REASONING_PARSERS)
        self.tool_call = check_name("tool-call-parser", tool_call, TOOL_CALL_PARSERS)
        self.auto_tool_choice = auto_tool_choice
