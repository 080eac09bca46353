"""The part of answering that every generating route shares: a reply's text, read once by the
server's parsers into typed events (reasoning, content, tool calls), whole or streamed.

Chat completions, the Responses API and Anthropic's Messages API all read a reply through one
ReplyParser, so a model's reasoning and calls come out the same on each, whole or streamed;
each route's adapter renders the events in its API's shape. Which parsers run is decided once
per server (Parsers, from the flags or the chat template) and once per request (`for_request`:
a forced tool call or a grammar leaves no room for reasoning the prompt opened).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.parsers.events import ContentDelta, Event, Parsed, joined
from conveyor.entrypoints.parsers.reasoning import ReasoningParser, reasoning_parser
from conveyor.entrypoints.parsers.select import chosen
from conveyor.entrypoints.parsers.tools import tool_parser
from conveyor.entrypoints.parsers.tools.stream import ToolStream

DEFAULT_TOOL_PARSER = "hermes"  # conveyor's reading before parsers had names


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


@dataclass(frozen=True, slots=True)
class Parsers:
    """The server's parsers: those named on the command line, the rest chosen from the chat
    template (parsers/select.py)."""

    names: ParserNames

    @classmethod
    def of(cls, names: ParserNames, chat_template: str | None) -> Parsers:
        return cls(chosen(names, chat_template))

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


def _opens_reasoning(tail: str) -> bool:
    """Whether a prompt ends inside a <think> block its template opened."""
    return tail.rfind("<think>") > tail.rfind("</think>")
