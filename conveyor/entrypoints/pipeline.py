"""The part of answering that every generating route shares: a reply read once into typed
events (reasoning, content, tool calls, then its finish with usage), whole or streamed.

Chat completions, the Responses API and Anthropic's Messages API all read a reply through one
ReplyReader, so a model's reasoning and calls come out the same on each, whole or streamed,
and a forced call (tool_choice required or named) comes out as the same call events as one
the model chose; each route's adapter renders the events in its API's shape. Which parsers run
is decided once per server (Parsers, from the flags or the chat template) and once per request
(`for_request`: a forced tool call or a grammar leaves no room for reasoning the prompt
opened). `generate` is the one loop from a request's engine outputs to those events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.parsers.events import (
    ContentDelta,
    Event,
    Parsed,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    joined,
)
from conveyor.entrypoints.parsers.reasoning import ReasoningParser, reasoning_parser
from conveyor.entrypoints.parsers.scan import MarkerScan
from conveyor.entrypoints.parsers.select import chosen
from conveyor.entrypoints.parsers.tools import tool_parser
from conveyor.entrypoints.parsers.tools.stream import ToolStream, call_events
from conveyor.structured.tools import parse_required

DEFAULT_TOOL_PARSER = "hermes"  # conveyor's reading before parsers had names

# The marker texts each parser reads. A family's tokenizer may make them special tokens,
# which the detokenizer's skip_special_tokens removes before a parser could see them.
_HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>")
_HARMONY += ("<|return|>",)
_THINK = ("<think>", "</think>")
REASONING_MARKERS: dict[str, tuple[str, ...]] = {
    "deepseek_r1": _THINK,
    "deepseek_v3": _THINK,
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


class Usage(NamedTuple):
    """What one request's tokens add up to, in neutral names (each API renames them)."""

    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0


class Finish(NamedTuple):
    """The last event of a reply. reason: the engine's ("stop", "length", "abort", "error"),
    or "tool_calls" when a reply that stopped made calls; stop: the stop string or token id
    that ended it."""

    reason: str | None
    stop: int | str | None
    usage: Usage


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply that stopped after making calls finished by calling (every API says so)."""
    return "tool_calls" if called and reason == "stop" else reason


def tidy(parsed: Parsed) -> Parsed:
    """A whole reply as every API shows it: no content beside its calls when it is blank."""
    if parsed.calls and parsed.content is not None and not parsed.content.strip():
        return parsed._replace(content=None)
    return parsed


class ReplyParser:
    """One reply's parsers in a row: the reasoning parser splits off the reasoning, the tool
    parser reads calls in what is left."""

    __slots__ = ("reasoning", "tools")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolStream | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        events = self.reasoning.feed(text) if self.reasoning else [ContentDelta(text)]
        return self._through_tools(events)

    def finish(self) -> list[Event]:
        events = self._through_tools(self.reasoning.finish()) if self.reasoning else []
        return events + (self.tools.finish() if self.tools else [])

    def parse(self, text: str) -> Parsed:
        """A whole reply: the same reading as a stream of it."""
        return joined(self.feed(text) + self.finish())

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for event in events:
            out += self.tools.feed(event.text) if isinstance(event, ContentDelta) else [event]
        return out


class Hidden:
    """Removes texts (special tokens) from text fed piece by piece, whatever the cuts."""

    __slots__ = ("_scan",)

    def __init__(self, texts: tuple[str, ...]) -> None:
        self._scan = MarkerScan(texts) if texts else None

    def feed(self, text: str) -> str:
        if self._scan is None:
            return text
        kept = []
        found = self._scan.feed(text)
        while found.marker is not None:
            kept.append(found.before)
            found = self._scan.feed(found.after)
        return "".join(kept) + found.before

    def flush(self) -> str:
        return self._scan.flush() if self._scan is not None else ""

    def whole(self, text: str) -> str:
        """A whole text, apart from what was fed."""
        if self._scan is None:
            return text
        fresh = Hidden(self._scan.markers)
        return fresh.feed(text) + fresh.flush()


class ReplyReader:
    """One reply in its request's tool mode, as events. auto and none: the server's parsers
    read it; named: the text is the function's arguments, streamed as they come; required:
    the text is a JSON list of calls, sent once complete. A forced reply cut by max_tokens is
    never content: required keeps the calls completed before the cut, named the arguments
    written so far, as OpenAI does. hidden: special tokens decoded so that the parsers see
    their markers, which the client must not see (they are removed before any reading)."""

    __slots__ = ("mode", "name", "parser", "max_depth", "hidden", "_held", "_started")
    __slots__ += ("num_calls",)

    def __init__(
        self,
        mode: str,
        parser: ReplyParser | None,
        name: str | None,
        max_depth: int,
        hidden: tuple[str, ...] = (),
    ) -> None:
        self.mode, self.name, self.max_depth = mode, name, max_depth
        self.parser = parser if mode in ("auto", "none") else None
        self.hidden = Hidden(hidden)
        self._held: list[str] = []  # required: the reply, joined once at its end
        self._started = False
        self.num_calls = 0

    def feed(self, text: str, finished: bool = False) -> list[Event]:
        """The events of one more piece of the reply (finished: it is the last)."""
        text = self.hidden.feed(text) + (self.hidden.flush() if finished else "")
        if self.mode == "named":
            events = self._named(text, finished)
        elif self.mode == "required":
            self._held.append(text)
            events = [] if not finished else call_events(self._required(), "")
        else:
            events = self.parser.feed(text) + (self.parser.finish() if finished else [])
        self.num_calls += sum(isinstance(event, ToolCallStart) for event in events)
        return events

    def parse(self, text: str) -> Parsed:
        """The whole reply's reasoning, content and calls (content None beside calls when it
        is blank, and for a forced call), apart from what this reader was fed."""
        text = self.hidden.whole(text)
        if self.mode == "named":
            return Parsed(None, None, [(self.name, text)])
        if self.mode == "required":
            return Parsed(None, None, list(parse_required(text, self.max_depth)))
        return tidy(self.parser.parse(text))

    def _named(self, text: str, finished: bool) -> list[Event]:
        events: list[Event] = []
        if not self._started:
            self._started = True
            events.append(ToolCallStart(0, self.name))
        if text:
            events.append(ToolArgsDelta(0, text))
        return events + ([ToolCallEnd(0)] if finished else [])

    def _required(self) -> list:
        return parse_required("".join(self._held), self.max_depth)


@dataclass(slots=True)
class Tally:
    """What a reply's outputs add up to so far, besides its text."""

    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def usage(self, num_prompt_tokens: int) -> Usage:
        return Usage(num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)


async def generate(
    stream: RequestStream, reader: ReplyReader, num_prompt_tokens: int, tally: Tally | None = None
) -> AsyncIterator[Event | Finish]:
    """The events of a one-choice request's reply, then its Finish: the one loop from engine
    outputs to what the Responses and Messages adapters render. tally: kept up to date, for an
    adapter that tells the usage of a reply that fails before its Finish."""
    tally = tally if tally is not None else Tally()
    reason = stop = None
    async for out in stream:
        tally.num_cached_tokens = max(tally.num_cached_tokens, out.num_cached_tokens)
        for completion in out.outputs:
            tally.num_output_tokens += len(completion.token_ids)
            if completion.finish_reason is not None:
                reason, stop = completion.finish_reason, completion.stop_reason
            for event in reader.feed(completion.text, completion.finish_reason is not None):
                yield event
    called = reader.num_calls > 0
    yield Finish(finish_reason(reason, called), stop, tally.usage(num_prompt_tokens))


@dataclass(frozen=True, slots=True)
class Parsers:
    """The server's parsers: those named on the command line, the rest chosen from the chat
    template (parsers/select.py)."""

    names: ParserNames

    @classmethod
    def of(cls, names: ParserNames, chat_template: str | None) -> Parsers:
        return cls(chosen(names, chat_template))

    def markers(self, reasoning: bool, tools: bool) -> frozenset[str]:
        """The marker texts a request's parsers read (reasoning: its reasoning is parsed;
        tools: its calls are)."""
        names = self.names
        found: tuple[str, ...] = ()
        if reasoning and names.reasoning is not None:
            found += REASONING_MARKERS[names.reasoning]
        if tools:
            found += TOOL_MARKERS[names.tool_call or DEFAULT_TOOL_PARSER]
        return frozenset(found)

    def hidden(
        self, specials: frozenset[str], reasoning: bool, tools: bool
    ) -> tuple[str, ...] | None:
        """None when none of a request's markers is one of the tokenizer's special tokens
        (specials); else those others, which the client must not see once the reply is
        decoded with its special tokens so that the parsers see their markers."""
        markers = self.markers(reasoning, tools)
        if not markers & specials:
            return None
        return tuple(sorted(specials - markers))

    def for_request(
        self,
        tools: dict[str, dict] | None,
        max_depth: int,
        prompt_text_tail: str = "",
        constrained: bool = False,
        template_kwargs: dict | None = None,
    ) -> ReplyParser:
        """A fresh ReplyParser for one reply. tools: the declared functions' parameters, when
        tool_choice is auto (None: no calls are read). prompt_text_tail: the prompt's end, to
        see whether the template opened the reasoning. constrained: a grammar shapes the reply
        from its first token, so it holds no reasoning the prompt opened."""
        reasoning = None
        if self.names.reasoning is not None:
            opened = not constrained and _opens_reasoning(prompt_text_tail)
            reasoning = reasoning_parser(self.names.reasoning, opened, template_kwargs)
            if constrained and self.names.reasoning in ("deepseek_r1", "deepseek_v3"):
                reasoning = None  # these read reasoning the prompt opened even unmarked
        calls = None
        if tools is not None:
            calls = tool_parser(self.names.tool_call or DEFAULT_TOOL_PARSER, tools, max_depth)
        return ReplyParser(reasoning, calls)


def special_texts(tokenizer) -> frozenset[str]:
    """The texts of the tokens that skip_special_tokens removes."""
    if tokenizer is None:
        return frozenset()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {token.content for token in added.values() if getattr(token, "special", False)}
    return frozenset(specials | set(getattr(tokenizer, "all_special_tokens", ())))


def _opens_reasoning(tail: str) -> bool:
    """Whether a prompt ends inside a <think> block its template opened."""
    return tail.rfind("<think>") > tail.rfind("</think>")
