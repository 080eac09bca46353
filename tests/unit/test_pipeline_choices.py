"""The shared pipeline's choices (pipeline.Choices): several prompts, n choices each, copies,
usage and per-choice readers, from engine outputs merged across the prompts' streams."""

from __future__ import annotations

import asyncio

from conveyor.engine.streams import RequestStream
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.parsers.events import ContentDelta, ReasoningDelta
from conveyor.entrypoints.pipeline import Choices, Parsers, PromptState, ReplyReader, Usage
from conveyor.outputs import CompletionOutput, RequestOutput


def _out(request_id: str, index: int, text: str, ids: list[int], finish=None, cached=0):
    completion = CompletionOutput(index, text, ids, None, None, finish_reason=finish)
    return RequestOutput(request_id, None, [], [completion], False, num_cached_tokens=cached)


def _stream(loop, request_id: str, outputs: list[RequestOutput]) -> RequestStream:
    """A stream of outputs; the request finishes with its last."""
    stream = RequestStream(request_id, loop)
    outputs[-1].finished = True
    for out in outputs:
        stream.put_local(out)
    return stream


def test_choices_of_two_prompts_with_n_two_add_up_whole_with_usage():
    async def run():
        loop = asyncio.get_running_loop()
        a = [_out("a", 0, "x", [1]), _out("a", 1, "y", [2], cached=3)]
        a += [_out("a", 0, "z", [3], "stop"), _out("a", 1, "w", [4, 5], "length")]
        b = [_out("b", 0, "p", [6], "stop"), _out("b", 1, "q", [7], "stop")]
        prompts = [PromptState([10, 11, 12, 13]), PromptState([20, 21])]
        choices = Choices(prompts, n=2, keep=True)
        whole = await choices.collect([_stream(loop, "a", a), _stream(loop, "b", b)])
        return whole, choices.usage()

    whole, usage = asyncio.run(run())
    assert [c.text for c in whole] == ["xz", "yw", "p", "q"]
    assert [c.token_ids for c in whole] == [[1, 3], [2, 4, 5], [6], [7]]
    assert [c.finish_reason for c in whole] == ["stop", "length", "stop", "stop"]
    assert usage == Usage(6, 7, 3)


def test_copies_send_one_completion_as_several_choices():
    async def run():
        loop = asyncio.get_running_loop()
        choices = Choices([PromptState([1, 2])], n=1, copies=3, keep=True)
        return await choices.collect([_stream(loop, "a", [_out("a", 0, "e", [], "length")])])

    assert [(c.index, c.text, c.finish_reason) for c in asyncio.run(run())] == [
        (0, "e", "length"),
        (1, "e", "length"),
        (2, "e", "length"),
    ]


def test_each_choice_is_read_by_its_own_reader_into_events():
    parsers = Parsers(ParserNames(reasoning="qwen3"))

    def reader(_: int) -> ReplyReader:
        return ReplyReader("none", parsers.for_request(None, 8), None, 8)

    async def run():
        loop = asyncio.get_running_loop()
        outputs = [_out("a", 0, "<think>hm", [1]), _out("a", 1, "plain", [2])]
        outputs += [_out("a", 0, "</think>yes", [3], "stop"), _out("a", 1, "", [], "stop")]
        choices = Choices([PromptState([1])], n=2, readers=reader)
        events: dict[int, list] = {0: [], 1: []}
        async for step in choices.steps([_stream(loop, "a", outputs)]):
            events[step.choice.index] += step.events
        return events

    events = asyncio.run(run())
    assert ReasoningDelta("hm") in events[0] and ContentDelta("yes") in events[0]
    assert "".join(e.text for e in events[1] if isinstance(e, ContentDelta)) == "plain"
