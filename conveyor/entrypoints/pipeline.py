"""The part of answering that every generating route shares: a reply read once into typed
events (reasoning, content, tool calls, then its finish with usage), whole or streamed.

Chat completions, the Responses API and Anthropic's Messages API all read a reply through one
ReplyReader, so a model's reasoning and calls come out the same on each, whole or streamed,
and a forced call (tool_choice required or named) comes out as the same call events as one
the model chose; each route's adapter renders the events in its API's shape. Which parsers run
is decided once per server (Parsers, from the flags or the chat template) and once per request
(`for_request`: a forced tool call or a grammar leaves no room for reasoning the prompt
opened). `Choices` is the one loop from a request's engine outputs (several prompts, n choices
each) to its choices, their events and their usage; `generate` is its one-choice form.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from conveyor.engine.streams import RequestStream
from conveyor.entrypoints import parsers
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
from conveyor.entrypoints.parsers.tools.forced import harmony_final, lark_marker
from conveyor.entrypoints.parsers.tools.stream import ToolStream, call_events
from conveyor.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from conveyor.sampling_params import ReasoningBounds
from conveyor.structured.params import StructuredOutputs
from conveyor.structured.tools import parse_required

DEFAULT_TOOL_PARSER = "hermes"  # conveyor's reading before parsers had names


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
    the text is a JSON list of calls, sent once complete; forced: a required or named call
    that a grammar made the model write in its family's syntax (parsers/tools/forced.py),
    read by the server's parsers, its reasoning too, and never content. A forced reply cut by
    max_tokens is
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
        self.parser = parser if mode in ("auto", "none", "forced") else None
        self.hidden = Hidden(hidden)
        self._held: list[str] = []  # required: the reply, joined once at its end
        self._started = False
        self.num_calls = 0

    def reasoning_bounds(self) -> ReasoningBounds | None:
        """Where the reply's reasoning is, when this reader parses one (the engine then
        matches stop strings after it only, bounds it by a budget and starts a grammar after
        it): between markers, or harmony's analysis channel."""
        reasoning = self.parser.reasoning if self.parser is not None else None
        return reasoning.bounds() if reasoning is not None else None

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
            if self.mode == "forced":
                events = [event for event in events if not isinstance(event, ContentDelta)]
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
        parsed = tidy(self.parser.parse(text))
        return parsed._replace(content=None) if self.mode == "forced" else parsed

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


@dataclass(slots=True)
class PromptState:
    """One prompt of a request, as its outputs fill it in: its tokens, its text (echo), its
    prompt logprobs and its prefix-cache hit."""

    token_ids: list[int]
    text: str | None = None
    logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # its request's times, once it finished

    def take(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.metrics is not None:
            self.metrics = out.metrics


def timing_metrics(metrics: RequestMetrics | None, num_tokens: int) -> dict:
    """vLLM's per-request metrics of a finished request (--enable-per-request-metrics): time
    to first token from its scheduling, its decode time (first token to last), its wait in
    the queue, the mean time between its tokens and its tokens per second from scheduling to
    the last; each None where its times are unknown. Milliseconds."""
    m = metrics
    start = None if m is None else m.first_scheduled_time
    first = None if m is None else m.first_token_time
    last = None if m is None else m.finished_time

    def ms(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else (b - a) * 1000.0

    decode = ms(first, last)
    span = ms(start, last)
    return {
        "time_to_first_token_ms": ms(start, first),
        "generation_time_ms": decode,
        "queue_time_ms": None if m is None else ms(m.arrival_time, start),
        "mean_itl_ms": decode / (num_tokens - 1) if decode is not None and num_tokens > 1 else None,
        "tokens_per_second": num_tokens / span * 1000.0 if span else None,
    }


@dataclass(slots=True)
class Choice:
    """One choice as its outputs add up; text, token ids and logprobs are kept only for a
    whole answer (a stream sends each piece once and keeps none)."""

    index: int
    prompt: PromptState
    num_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, PositionLogprobs]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_steps: int = 0  # pieces seen: a stream sends a choice's echo with its first

    def take(self, output: CompletionOutput, keep: bool) -> None:
        self.num_tokens += len(output.token_ids)
        self.num_steps += 1
        if output.finish_reason is not None:
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        if keep:
            self.text += output.text
            self.token_ids += output.token_ids
            if output.logprobs:
                self.logprobs += zip(output.token_ids, output.logprobs, strict=True)


class Step(NamedTuple):
    """One piece of one choice's output: the engine's delta (tokens, logprobs, finish) and
    the events its reader read in it (none for a route that reads no events)."""

    choice: Choice
    output: CompletionOutput
    events: list[Event]


class Choices:
    """The choices of one request, whatever its API: n per prompt, in prompt order, each
    completion sent as `copies` choices (a prompt-only request computed once for all n), each
    choice read by its own reader (readers: the reader of choice i; None: no events). The one
    loop from engine outputs to choices, their events and their usage."""

    def __init__(
        self,
        prompts: list[PromptState],
        n: int = 1,
        copies: int = 1,
        readers: Callable[[int], ReplyReader] | None = None,
        keep: bool = False,
    ) -> None:
        self.prompts, self.n, self.copies, self.keep = prompts, n, copies, keep
        width = n * copies
        self.choices = [Choice(i, prompts[i // width]) for i in range(len(prompts) * width)]
        self.readers = [readers(i) for i in range(len(self.choices))] if readers else None

    def usage(self) -> Usage:
        """Every prompt's tokens and prefix-cache hits, every choice's output tokens so far."""
        return Usage(
            sum(len(p.token_ids) for p in self.prompts),
            sum(c.num_tokens for c in self.choices),
            sum(p.num_cached_tokens for p in self.prompts),
        )

    def finish(self, choice: Choice) -> Finish:
        """A finished choice's Finish: a reply that stopped after calls finished by calling."""
        readers = self.readers
        called = readers is not None and readers[choice.index].num_calls > 0
        reason = finish_reason(choice.finish_reason, called)
        return Finish(reason, choice.stop_reason, self.usage())

    async def steps(self, streams: list[RequestStream]) -> AsyncIterator[Step]:
        """Each choice's pieces in arrival order, merged across the prompts' streams; each
        prompt's state takes what its outputs say of the prompt first."""
        async for prompt_index, out in merged(streams):
            self.prompts[prompt_index].take(out)
            for completion in out.outputs:
                first = (prompt_index * self.n + completion.index) * self.copies
                for index in range(first, first + self.copies):
                    yield self._step(self.choices[index], completion)

    async def collect(self, streams: list[RequestStream]) -> list[Choice]:
        """Every choice whole (keep must be set)."""
        async for _ in self.steps(streams):
            pass
        return self.choices

    def _step(self, choice: Choice, output: CompletionOutput) -> Step:
        choice.take(output, self.keep)
        if self.readers is None:
            return Step(choice, output, [])
        reader = self.readers[choice.index]
        return Step(choice, output, reader.feed(output.text, output.finish_reason is not None))


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) in arrival order across the prompts' streams."""
    if len(streams) == 1:  # the common case: no merging, no task per output
        async for out in streams[0]:
            yield 0, out
        return
    iterators = [stream.__aiter__() for stream in streams]
    pending = {asyncio.ensure_future(_anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield index, out
                pending[asyncio.ensure_future(_anext(iterators[index]))] = index
    finally:
        for task in pending:
            task.cancel()


async def _anext(iterator):
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return None


class CallSpacing:
    """Drops the blanks beside a call from a reply's content: those before a call's start
    and those after its end up to the next text. They are the family's spacing between its
    calls (`</tool_call>\\n<tool_call>`), not text: an API that shows text as items or blocks
    of its own would show them as blank ones between the calls, and Anthropic's whole
    message, whose text is one block, as part of it. Blanks elsewhere are kept; a content's
    trailing blanks are held until it is known whether a call follows."""

    __slots__ = ("_held", "_after_call")

    def __init__(self) -> None:
        self._held = ""
        self._after_call = False

    def feed(self, event: Event) -> list[Event]:
        if isinstance(event, ContentDelta):
            text = self._held + event.text
            text = text.lstrip() if self._after_call else text
            kept = text.rstrip()
            self._held = text[len(kept) :]
            self._after_call = self._after_call and not kept
            return [ContentDelta(kept)] if kept else []
        if isinstance(event, ToolCallStart):
            self._held = ""
        elif isinstance(event, ToolCallEnd):
            self._after_call = True
        return [event]

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        return [ContentDelta(held)] if held else []


async def generate(
    stream: RequestStream, reader: ReplyReader, prompt: list[int], tally: Tally | None = None
) -> AsyncIterator[Event | Finish]:
    """The events of a one-choice request's reply, then its Finish, as the Responses and
    Messages adapters render them: text as items or blocks of their own, so without the
    blanks beside its calls (CallSpacing). tally: kept up to date, for an adapter that tells
    the usage of a reply that fails before its Finish."""
    tally = tally if tally is not None else Tally()
    choices = Choices([PromptState(prompt)], readers=lambda _: reader)
    spacing = CallSpacing()
    async for step in choices.steps([stream]):
        tally.num_output_tokens = step.choice.num_tokens
        tally.num_cached_tokens = step.choice.prompt.num_cached_tokens
        for event in step.events:
            for spaced in spacing.feed(event):
                yield spaced
    for event in spacing.finish():
        yield event
    yield choices.finish(choices.choices[0])


@dataclass(frozen=True, slots=True)
class Parsers:
    """The server's parsers: those named on the command line, the rest chosen from the chat
    template (parsers/select.py)."""

    names: ParserNames

    @classmethod
    def of(cls, names: ParserNames, chat_template: str | None) -> Parsers:
        return cls(chosen(names, chat_template))

    @property
    def marks_reasoning(self) -> bool:
        """Whether replies' reasoning is read, so that the engine can find where it ends
        (between markers, or harmony's analysis channel)."""
        return self.names.reasoning is not None

    @property
    def harmony(self) -> bool:
        """Whether replies are harmony's channels: an answer's grammar is then written in
        the final channel (parsers/tools/forced.harmony_final)."""
        return self.names.reasoning == "openai_gptoss"

    def answer_constraint(
        self, constraint: StructuredOutputs | None, marker: Callable[[str], str]
    ) -> StructuredOutputs | None:
        """A reply's own constraint as its answer is written: in harmony's final channel when
        the replies are harmony's (a Lark grammar is the whole answer's, header included)."""
        if constraint is None or not self.harmony or constraint.kind == "grammar":
            return constraint
        return StructuredOutputs(grammar=harmony_final(constraint, marker))

    def markers(self, reasoning: bool, tools: bool) -> frozenset[str]:
        """The marker texts a request's parsers read (reasoning: its reasoning is parsed;
        tools: its calls are)."""
        names = self.names
        found: tuple[str, ...] = ()
        if reasoning and names.reasoning is not None:
            found += parsers.REASONING_MARKERS[names.reasoning]
        if tools:
            found += parsers.TOOL_MARKERS[names.tool_call or DEFAULT_TOOL_PARSER]
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
        from its first token, so it holds no reasoning the prompt opened (a grammar that
        starts after marked reasoning does not)."""
        reasoning = None
        if self.names.reasoning is not None:
            opened = not constrained and _opens_reasoning(prompt_text_tail, self.names.reasoning)
            reasoning = reasoning_parser(self.names.reasoning, opened, template_kwargs)
            if constrained and self.names.reasoning in ("deepseek_r1", "deepseek_v3"):
                reasoning = None  # these read reasoning the prompt opened even unmarked
        calls = None
        if tools is not None:
            calls = tool_parser(self.names.tool_call or DEFAULT_TOOL_PARSER, tools, max_depth)
        return ReplyParser(reasoning, calls)


def tokenized(bounds: ReasoningBounds, tokenizer, budget: int | None = None) -> ReasoningBounds:
    """bounds with the token ids the engine core finds its markers by (a family's markers
    are special tokens: one id each), and a thinking budget."""

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return replace(
        bounds,
        opening_ids=tuple(ids(marker) for marker in bounds.opening),
        closing_ids=tuple(ids(marker) for marker in bounds.closing),
        forced_tail_ids=ids(bounds.forced_tail) if bounds.forced_tail else (),
        budget=budget,
    )


def marker_terminal(tokenizer, specials: frozenset[str]) -> Callable[[str], str]:
    """A marker as a Lark terminal for this tokenizer: a special token's id, else its text."""

    def terminal(text: str) -> str:
        special = text in specials
        return lark_marker(text, tokenizer.convert_tokens_to_ids(text) if special else None)

    return terminal


def special_texts(tokenizer) -> frozenset[str]:
    """The texts of the tokens that skip_special_tokens removes."""
    if tokenizer is None:
        return frozenset()
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {token.content for token in added.values() if getattr(token, "special", False)}
    return frozenset(specials | set(getattr(tokenizer, "all_special_tokens", ())))


def _opens_reasoning(tail: str, parser: str | None = None) -> bool:
    """Whether a prompt ends inside a reasoning block its template opened: a <think> block, or
    Gemma 4's channel block."""
    opener, closer = _REASONING_BLOCKS.get(parser, ("<think>", "</think>"))
    return tail.rfind(opener) > tail.rfind(closer)


_REASONING_BLOCKS = {"gemma4": ("<|channel>", "<channel|>")}
