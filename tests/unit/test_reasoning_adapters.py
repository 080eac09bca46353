"""Reasoning in each API's own shape: the Responses API's reasoning items and
response.reasoning_text.delta events, Anthropic's thinking blocks and thinking_delta events,
built from the typed events every route's reply reader (pipeline.ReplyReader) writes."""

from __future__ import annotations

import json

from conveyor.entrypoints.anthropic.serving import _Blocks
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest
from conveyor.entrypoints.openai.responses.output import OutputBuilder
from conveyor.entrypoints.openai.serving import _ToolReply
from conveyor.entrypoints.parsers import ParserNames
from conveyor.entrypoints.pipeline import CallSpacing, Parsers

RAW = "<think>Let me see.</think>\n\nParis."


ARGS = '{"city": "Paris", "days": [1, 2]}'
CALL = f'<think>Hm.</think><tool_call>{{"name": "get_weather", "arguments": {ARGS}}}</tool_call>'


def deltas(raw: str = RAW, tools: dict | None = None) -> list:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    parsers = Parsers(ParserNames("qwen3", "hermes" if tools else None))
    reply = _ToolReply(request, 16, parsers.for_request(tools, 16))
    out = []
    for i, piece in enumerate(raw[j : j + 3] for j in range(0, len(raw), 3)):
        out += reply.reader.feed(piece, finished=i == (len(raw) - 1) // 3)
    return out


def test_responses_output_has_a_reasoning_item_before_the_message():
    builder = OutputBuilder(plain=True)
    events = [event for delta in deltas() for event in builder.feed(delta)]
    events += builder.finish("completed")
    reasoning, message = builder.items
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me see."}]
    assert message["content"][0]["text"] == "Paris."
    pieces = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(pieces) == "Let me see."
    (done,) = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == "Let me see."


def test_anthropic_stream_opens_a_thinking_block_then_a_text_block():
    blocks = _Blocks()
    frames = [frame for delta in deltas() for frame in blocks.feed(delta)] + blocks.close()
    data = [json.loads(frame.split("data: ", 1)[1]) for frame in frames]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = [
        d["delta"]["thinking"] for d in data if d.get("delta", {}).get("type") == "thinking_delta"
    ]
    assert "".join(thinking) == "Let me see."


def test_responses_and_anthropic_streams_send_a_calls_arguments_in_pieces():
    tools = {"get_weather": {"type": "object"}}
    builder = OutputBuilder(plain=True)
    events = [event for delta in deltas(CALL, tools) for event in builder.feed(delta)]
    events += builder.finish("completed")
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == ARGS
    blocks = _Blocks()
    frames = [frame for delta in deltas(CALL, tools) for frame in blocks.feed(delta)]
    data = [json.loads(frame.split("data: ", 1)[1]) for frame in frames + blocks.close()]
    pieces = [
        d["delta"]["partial_json"]
        for d in data
        if d.get("delta", {}).get("type") == "input_json_delta"
    ]
    assert len(pieces) > 1 and "".join(pieces) == ARGS


def spaced_items(raw: str) -> list[tuple[str, str]]:
    """The Responses API's items of a hermes reply, as generate() spaces its events."""
    spacing, builder = CallSpacing(), OutputBuilder(plain=True)
    tools = {"get_weather": {"type": "object"}}
    events = [spaced for delta in deltas(raw, tools) for spaced in spacing.feed(delta)]
    for event in events + spacing.finish():
        builder.feed(event)
    builder.finish("completed")
    return [(item["type"], item.get("content", [{}])[0].get("text")) for item in builder.items]


def test_the_blanks_beside_calls_make_no_item_and_other_blanks_are_kept():
    call = CALL.removeprefix("<think>Hm.</think>")
    assert spaced_items(f"Sure. {call}\n{call}\n\nDone. \n") == [
        ("message", "Sure."),
        ("function_call", None),
        ("function_call", None),
        ("message", "Done. \n"),
    ]
    assert spaced_items(f" \n{call} ") == [("function_call", None)]
    assert spaced_items("Paris, \n France. \n") == [("message", "Paris, \n France. \n")]


def test_anthropic_whole_message_has_the_streams_blocks_in_the_replys_order():
    call = CALL.removeprefix("<think>Hm.</think>")
    blocks = _Blocks()
    frames = [
        frame
        for delta in deltas(f"{call}\nDone.", {"get_weather": {}})
        for frame in blocks.feed(delta)
    ]
    data = [json.loads(frame.split("data: ", 1)[1]) for frame in frames + blocks.close()]
    starts = [d["content_block"]["type"] for d in data if d["type"] == "content_block_start"]
    assert starts == [block["type"] for block in blocks.content] == ["tool_use", "text"]
    assert blocks.content[0]["input"] == json.loads(ARGS)
    assert blocks.content[1]["text"] == "\nDone."
