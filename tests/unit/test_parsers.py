"""Reasoning and tool-call parsers by vLLM's names: each family's raw text becomes its
reasoning, content and calls; streamed over any cuts, the pieces re-joined are the whole
reply's; a malformed call is content, never an exception."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.entrypoints.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, ParserNames
from conveyor.entrypoints.parsers.events import (
    Parsed,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    joined,
)
from conveyor.entrypoints.parsers.tools import tool_parser
from conveyor.entrypoints.parsers.tools.other_formats import read_qwen3_coder
from conveyor.entrypoints.parsers.tools.stream import ToolContext
from conveyor.entrypoints.pipeline import Hidden, Parsers, ReplyParser

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
    "add": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}},
}
W = '{"city": "Paris"}'
NESTED = '{"city": "Paris", "when": {"days": [1, 2, {"x": null}]}}'
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
DS_SEP, DS_END = "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
Q = '<|"|>'  # Gemma 4's string delimiter

# (reasoning parser, tool parser, raw reply) -> (reasoning, content, [(name, arguments)])
CASES = [
    ("qwen3", None, "<think>\nI ponder.\n</think>\n\nParis.", ("I ponder.\n", "Paris.", [])),
    ("qwen3", None, "Paris.", (None, "Paris.", [])),
    ("think", None, "<think>unclosed", ("unclosed", None, [])),
    ("deepseek_r1", None, "ponder</think>Paris.", ("ponder", "Paris.", [])),
    ("mistral", None, "[THINK]hm[/THINK]Yes.", ("hm", "Yes.", [])),
    (
        "granite",
        None,
        "Here is my thought process: a. Here is my response: b.",
        ("a. ", "b.", []),
    ),
    (
        "openai_gptoss",
        None,
        "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
        "<|message|>Answer.<|return|>",
        ("think", "Answer.", []),
    ),
    (
        "qwen3",
        "hermes",
        f'<think>need weather</think>\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}'
        "\n</tool_call>",
        ("need weather", None, [("get_weather", W)]),
    ),
    (
        None,
        "hermes",
        f'Sure. <tool_call>{{"name": "get_weather", "arguments": {W}}}</tool_call>'
        f'<tool_call>{{"name": "add", "arguments": {{"a": 1}}}}</tool_call>',
        (None, "Sure. ", [("get_weather", W), ("add", '{"a": 1}')]),
    ),
    (
        None,
        "hermes",
        f'{{"name": "get_weather", "arguments": {NESTED}}}',
        (None, None, [("get_weather", NESTED)]),
    ),
    (
        None,
        "hermes",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        (None, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ),
    (
        None,
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; '
        '{"name": "add", "parameters": {"a": 1}}',
        (None, None, [("get_weather", W), ("add", '{"a": 1}')]),
    ),
    (None, "llama3_json", "Hello {there", (None, "Hello {there", [])),
    (
        None,
        "pythonic",
        '[get_weather(city="Paris"), add(a=1, b=2.5)]',
        (None, None, [("get_weather", W), ("add", '{"a": 1, "b": 2.5}')]),
    ),
    (None, "pythonic", "[__import__('os')]", (None, "[__import__('os')]", [])),
    (
        None,
        "llama4_pythonic",
        'Ok <|python_start|>[get_weather(city="Paris")]<|python_end|>',
        (None, "Ok ", [("get_weather", W)]),
    ),
    (
        None,
        "mistral",
        f'Hi[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]',
        (None, "Hi", [("get_weather", W)]),
    ),
    (
        None,
        "mistral",
        f'[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]add[ARGS]{{"a": 1}}',
        (None, None, [("get_weather", W), ("add", '{"a": 1}')]),
    ),
    (
        None,
        "qwen3_coder",
        "Let me check.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
        "<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>",
        (None, "Let me check.\n", [("add", '{"a": 1, "b": 2.5}')]),
    ),
    (
        None,
        "qwen3_xml",
        "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>",
        (None, None, [("get_weather", W)]),
    ),
    (
        "openai_gptoss",
        "openai",
        "<|channel|>analysis<|message|>call it<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.get_weather <|constrain|>json<|message|>{W}<|call|>",
        ("call it", None, [("get_weather", W)]),
    ),
    (
        None,
        "deepseek_v3",
        f"Hi{DS}function{DS_SEP}get_weather\n```json\n{W}\n```{DS_END}<｜tool▁calls▁end｜>",
        (None, "Hi", [("get_weather", W)]),
    ),
    (
        None,
        "deepseek_v3",
        f'{DS}add{DS_SEP}{{"a": 1}}{DS_END}<｜tool▁calls▁end｜>',
        (None, None, [("add", '{"a": 1}')]),
    ),
    (
        None,
        "deepseek_v3",
        f'Hi{DS}add{DS_SEP}{{"a": 1}}{DS_END}<｜tool▁call▁begin｜>add{DS_SEP} {{"a": 2}}\n'
        f"{DS_END}<｜tool▁calls▁end｜>",
        (None, "Hi", [("add", '{"a": 1}'), ("add", '{"a": 2}')]),
    ),
    (None, "deepseek_v3", "x<｜tool▁calls▁end｜>", (None, "x<｜tool▁calls▁end｜>", [])),
    (
        None,
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {W}}}]',
        (None, None, [("get_weather", W)]),
    ),
    ("gemma4", None, "<|channel>thought\nI ponder.<channel|>Paris.", ("I ponder.", "Paris.", [])),
    ("gemma4", None, "Paris.", (None, "Paris.", [])),
    ("gemma4", None, "<|channel>thought<channel|>Hi", (None, "Hi", [])),  # the label alone
    ("gemma4", None, "<|channel>thou<channel|>Hi", ("thou", "Hi", [])),
    ("gemma4", None, "<|channel>thought\nunclosed", ("unclosed", None, [])),
    ("gemma4", None, "A<channel|>B<|channel>thought\nC", ("C", "AB", [])),
    (
        "gemma4",
        "gemma4",
        f"<|channel>thought\nneed weather<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}"
        "<tool_call|><|tool_call>call:add{a:1,b:2.5}<tool_call|>",
        ("need weather", None, [("get_weather", W), ("add", '{"a": 1, "b": 2.5}')]),
    ),
    (
        None,
        "gemma4",
        f"Sure.<|tool_call>call:get_weather{{city:{Q}Paris{Q},when:{{days:[1,2,{{x:null}}]}}}}"
        "<tool_call|>Done.",
        (None, "Sure.Done.", [("get_weather", NESTED)]),
    ),
    (
        None,
        "gemma4",
        "<|tool_call>call:nope{a:1}<tool_call|>",
        (None, "<|tool_call>call:nope{a:1}<tool_call|>", []),
    ),
]


def parser(reasoning: str | None, tool: str | None) -> ReplyParser:
    parsers = Parsers(ParserNames(reasoning, tool))
    return parsers.for_request(TOOLS if tool else None, 16)


def streamed(reply: ReplyParser, text: str, cuts: list[int]) -> Parsed:
    events, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += reply.feed(text[start:cut])
        start = cut
    return joined(events + reply.finish())


def normal(parsed: Parsed) -> tuple:
    calls = [(name, json.loads(arguments)) for name, arguments in parsed.calls]
    return parsed.reasoning, parsed.content, calls


@pytest.mark.parametrize(("reasoning", "tool", "text", "expected"), CASES)
def test_each_family_reply_parses_into_reasoning_content_and_calls(reasoning, tool, text, expected):
    parsed = parser(reasoning, tool).parse(text)
    want_calls = [(name, json.loads(arguments)) for name, arguments in expected[2]]
    assert normal(parsed) == (expected[0], expected[1], want_calls)


@pytest.mark.parametrize(("reasoning", "tool", "text", "expected"), CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_pieces_rejoin_to_the_whole_parse_over_any_cuts(
    reasoning, tool, text, expected, data
):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert streamed(parser(reasoning, tool), text, cuts) == parser(reasoning, tool).parse(text)


FRAGMENTS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[THINK]",
    "[/THINK]",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|start|>",
    "analysis",
    "final",
    "commentary to=functions.add",
    '{"name": "add", "arguments": {"a": 1}}',
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    "add(a=1)",
    '<tool_call>{"name": "add", "arguments": ',
    '{"name": "get_weather", "arguments": ',
    '{"a": 1}',
    "add[ARGS]",
    "get_weather[ARGS]",
    "<function=add>",
    "<parameter=a>",
    "</parameter>",
    "</function>",
    "<|python_tag|>",
    "<|tool_call|>",
    DS,
    DS_SEP,
    DS_END,
    "Here is my response:",
    "Here is my thought process:",
    " ",
    "\n",
    "x",
    "<",
    "|",
    ";",
    '"',
    "<|channel>",
    "<channel|>",
    "thought\n",
    "<|tool_call>",
    "<tool_call|>",
    Q,
    "call:add{",
    "call:get_weather{",
    "a:",
    "city:",
    "1.5",
    ",",
    ":",
    "true",
]


@pytest.mark.parametrize("tool", TOOL_CALL_PARSERS)
@pytest.mark.parametrize("reasoning", [None, *REASONING_PARSERS])
@settings(max_examples=25, deadline=None)
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=14), data=st.data())
def test_any_text_streams_as_it_parses_whole_and_never_raises(tool, reasoning, pieces, data):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert streamed(parser(reasoning, tool), text, cuts) == parser(reasoning, tool).parse(text)


STREAMED_CALLS = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]%s"),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}]'),
    ("deepseek_v3", f"{DS}get_weather{DS_SEP}%s{DS_END}<｜tool▁calls▁end｜>"),
    ("deepseek_v3", f"{DS}function{DS_SEP}get_weather\n```json\n%s\n```{DS_END}"),
    ("llama3_json", '{"name": "get_weather", "parameters": %s}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": %s}'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": %s}]'),
    (
        "openai",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>%s<|call|>",
    ),
    (
        "openai",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        "%s<|call|>",
    ),
]


def argument_deltas(reply: ReplyParser, text: str) -> list[tuple[type, str]]:
    """The events of text fed one character at a time, as (kind, text) pairs."""
    events = [event for char in text for event in reply.feed(char)] + reply.finish()
    return [(type(event), getattr(event, "text", "")) for event in events]


@pytest.mark.parametrize(("tool", "template"), STREAMED_CALLS)
def test_a_calls_arguments_stream_as_they_come_once_its_name_is_read(tool, template):
    events = argument_deltas(parser(None, tool), template % NESTED)
    kinds = [kind for kind, _ in events]
    assert kinds[0] is ToolCallStart and kinds[-1] is ToolCallEnd
    pieces = [text for kind, text in events if kind is ToolArgsDelta]
    assert len(pieces) > len(NESTED) // 2  # sent while written, not once at the end
    assert "".join(pieces) == NESTED


@pytest.mark.parametrize(("tool", "template"), STREAMED_CALLS)
def test_a_committed_call_whose_arguments_break_ends_as_that_call_with_their_text(tool, template):
    cut = template.split("%s")[0] + NESTED[:20]  # the reply ends inside the arguments
    assert parser(None, tool).parse(cut).calls == [("get_weather", NESTED[:20])]
    malformed = template % '{"city": Paris}'  # not JSON: the call was sent, it stays one
    assert parser(None, tool).parse(malformed).calls == [("get_weather", '{"city": Paris}')]


def test_a_prompt_that_opens_the_reasoning_makes_the_reply_start_in_it():
    reply = Parsers(ParserNames("qwen3")).for_request(None, 16, "<|im_start|>assistant\n<think>\n")
    assert reply.parse("hm</think>Paris.")[:2] == ("hm", "Paris.")
    constrained = Parsers(ParserNames("qwen3")).for_request(None, 16, "<think>\n", True)
    assert constrained.parse('{"a": 1}')[:2] == (None, '{"a": 1}')
    # Gemma 4's channel block: opened by the prompt, or opened and closed there
    gemma4 = Parsers(ParserNames("gemma4"))
    opened = gemma4.for_request(None, 16, "<|turn>model\n<|channel>thought\n")
    assert opened.parse("hm<channel|>Paris.")[:2] == ("hm", "Paris.")
    closed = gemma4.for_request(None, 16, "<|turn>model\n<|channel>thought\n<channel|>")
    assert closed.parse("Paris.")[:2] == (None, "Paris.")


def test_deep_or_huge_replies_are_content_in_linear_time():
    deep = "<tool_call>" + '{"name": "add", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    assert parser(None, "hermes").parse(deep + "</tool_call>").calls == []
    reply = parser("qwen3", "pythonic")
    events = []
    for _ in range(20_000):
        events += reply.feed("<thi")
    assert joined(events + reply.finish()).content.startswith("<thi")
    reply = parser(None, "hermes")
    events = reply.feed('<tool_call>{"name": "add", "arguments": {"a": "')
    for _ in range(100_000):
        events += reply.feed("} ")
    assert len(joined(events + reply.finish()).calls[0][1]) == 7 + 200_000 - len(" } ")


def test_the_template_names_the_parsers_only_when_unambiguous():
    qwen = "{{'<|im_start|>'}}<think></think><tool_call></tool_call>"
    assert vars_of(Parsers.of(ParserNames(), qwen)) == ("qwen3", "hermes")
    gemma4 = "{{'<|channel>thought\\n' + t + '<channel|>'}}{{'<|tool_call>call:'}}'}<tool_call|>'"
    assert vars_of(Parsers.of(ParserNames(), gemma4)) == ("gemma4", "gemma4")
    assert vars_of(Parsers.of(ParserNames(), "<think>[THINK]")) == (None, None)
    assert vars_of(Parsers.of(ParserNames("think", "mistral"), qwen)) == ("think", "mistral")
    assert vars_of(Parsers.of(ParserNames(), None)) == (None, None)


def vars_of(parsers: Parsers) -> tuple:
    return parsers.names.reasoning, parsers.names.tool_call


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["<|end|>", "<|e", "nd|>", "a", "<|", "|>", "[THINK]"])),
    data=st.data(),
)
def test_hidden_special_tokens_are_removed_over_any_cuts(pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    hidden = Hidden(("<|end|>", "<|im_end|>"))
    bounds = [0, *cuts, len(text)]
    out = "".join(hidden.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    out += hidden.flush()
    expected = re.sub(r"<\|end\|>|<\|im_end\|>", "", text)  # one pass, left to right
    assert out == expected == hidden.whole(text)


XML_PARAMETERS = {
    "type": "object",
    "properties": {"note": {"type": "string"}, "days": {"type": "integer"}, "where": {}},
}
XML_CALL = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=note>\n"
    'a "quoted" <b> line\n\nand \\ more\n</parameter>\n<parameter=days>\n3\n</parameter>\n'
    '<parameter=where>\n{"lat": [1, {"b": null}]}\n</parameter>\n</function>\n</tool_call>'
)


@pytest.mark.parametrize("tool", ["qwen3_coder", "qwen3_xml"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_xml_parameters_stream_as_json_that_joins_to_the_whole_reading(tool, data):
    """Qwen3-Coder's <parameter> blocks stream as the JSON the whole reading makes (vLLM
    #30439): a string as it comes, other values once their block closes, over any cuts."""
    context = ToolContext({"get_weather": XML_PARAMETERS}, 16)
    (whole,) = read_qwen3_coder(XML_CALL, context).calls
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(XML_CALL)), max_size=40))))
    stream, events, start = tool_parser(tool, {"get_weather": XML_PARAMETERS}, 16), [], 0
    for cut in [*cuts, len(XML_CALL)]:
        events += stream.feed(XML_CALL[start:cut])
        start = cut
    events += stream.finish()
    pieces = [event.text for event in events if isinstance(event, ToolArgsDelta)]
    assert "".join(pieces) == whole.arguments
    assert joined(events).calls == [("get_weather", whole.arguments)]
    assert joined(events).content == "Checking.\n"


def test_xml_arguments_stream_while_written_and_a_cut_call_is_still_an_object():
    def reply():
        return tool_parser("qwen3_coder", {"get_weather": XML_PARAMETERS}, 16)

    per_char = reply()
    events = [event for char in XML_CALL for event in per_char.feed(char)] + per_char.finish()
    assert len([event for event in events if isinstance(event, ToolArgsDelta)]) > 20
    cut = XML_CALL[: XML_CALL.index("line")]  # the reply ends inside the first string
    cut_reply = reply()
    parsed = joined(cut_reply.feed(cut) + cut_reply.finish())
    assert parsed.calls == [("get_weather", '{"note": "a \\"quoted\\" <b> "}')]


TRICKY = '{"q": "a; b}, {\\"name\\": \\"x\\"}", "n": [1, {"m": "]"}]}'
JOINED_RUNS = [
    ("llama3_json", '{"name": "get_weather", "parameters": %s} ; '
     '{"name": "add", "parameters": {}}'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": %s},\n{"name": "add", '
     '"arguments": {}}] and then'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": %s}, {"name": "add", '
     '"arguments": {}}] and then'),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "template"), JOINED_RUNS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_joined_calls_stream_each_call_to_where_its_json_ends_over_any_cuts(tool, template, data):
    """Llama 3's `; ` and Granite's `, ` runs of calls: a `;`, `},` or `]` inside a string is
    no end; each call's pieces join to its arguments as written, whatever the cuts."""
    text = template % TRICKY
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    parsed = streamed(parser(None, tool), text, cuts)
    assert parsed.calls == [("get_weather", TRICKY), ("add", "{}")]
    assert parsed.content == (" and then" if tool != "llama3_json" else None)
    assert parsed == parser(None, tool).parse(text)


def test_harmony_call_arguments_stream_after_the_analysis_channel():
    text = (
        "<|channel|>analysis<|message|>I should call it.<|end|><|start|>assistant<|channel|>"
        f"commentary to=functions.get_weather <|constrain|>json<|message|>{NESTED}<|call|>"
    )
    events = argument_deltas(parser("openai_gptoss", "openai"), text)
    pieces = [piece for kind, piece in events if kind is ToolArgsDelta]
    assert len(pieces) > len(NESTED) // 2 and "".join(pieces) == NESTED
    parsed = parser("openai_gptoss", "openai").parse(text)
    assert parsed.reasoning == "I should call it." and parsed.calls == [("get_weather", NESTED)]


PYTHONIC = "[get_weather(city=\"Pa, ris)\", days=[1, (2, 3)], note='it\\'s ]'), add(a=1, b=2.5)]"
PYTHONIC_ARGUMENTS = {"city": "Pa, ris)", "days": [1, [2, 3]], "note": "it's ]"}


@pytest.mark.parametrize(
    ("tool", "text", "content"),
    [
        ("pythonic", PYTHONIC, None),
        ("llama4_pythonic", f"<|python_start|>{PYTHONIC}<|python_end|> Done.", " Done."),
    ],
)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_pythonic_calls_stream_each_keyword_once_its_value_ends_over_any_cuts(
    tool, text, content, data
):
    """A `,` `)` or `]` inside a string or brackets ends no value; each value is sent as JSON
    once it ends, so a call's pieces join to the whole reading's arguments."""
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    parsed = streamed(parser(None, tool), text, cuts)
    want = [("get_weather", json.dumps(PYTHONIC_ARGUMENTS)), ("add", '{"a": 1, "b": 2.5}')]
    assert parsed.calls == want and parsed.content == content
    assert parsed == parser(None, tool).parse(text)
    events = argument_deltas(parser(None, tool), text)
    # fed a character at a time: each key once its `=` is read, each value once it ends
    assert len([kind for kind, _ in events if kind is ToolArgsDelta]) == 6 + 4


GEMMA4_ARGUMENTS = (
    f'city:{Q}Pa, ris}}: {{x}} [1]\\ "q"\n{Q},days:[1, 2.5,{Q}a,b{Q},[],{{}}],'
    f"when:{{ok:true,no:false,none:None,nil:nil,word:soon,neg:-3}},empty:,rest:1}}"
)
GEMMA4_EXPECTED = {
    "city": 'Pa, ris}: {x} [1]\\ "q"\n',
    "days": [1, 2.5, "a,b", [], {}],
    "when": {"ok": True, "no": False, "none": None, "nil": None, "word": "soon", "neg": -3},
}  # `empty:,` is a value that never starts: vLLM reads no further in its object


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_gemma4_arguments_stream_as_json_that_joins_to_the_whole_reading(data):
    """Gemma 4's `key:<|"|>text<|"|>` arguments become the JSON vLLM's reading dumps: a
    string as it comes, other values once they end; the pieces join to the whole's, over any
    cuts (the delimiter cut too)."""
    text = f"Let me see.<|tool_call>call:get_weather{{{GEMMA4_ARGUMENTS}<tool_call|>"
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    parsed = streamed(parser(None, "gemma4"), text, cuts)
    assert normal(parsed) == (None, "Let me see.", [("get_weather", GEMMA4_EXPECTED)])
    assert parsed == parser(None, "gemma4").parse(text)
    events = argument_deltas(parser(None, "gemma4"), text)
    pieces = [piece for kind, piece in events if kind is ToolArgsDelta]
    assert len(pieces) > 40  # the string a character at a time, each value once it ends
    assert json.loads("".join(pieces)) == GEMMA4_EXPECTED


def test_a_gemma4_call_cut_short_is_still_a_json_object():
    head = f"<|tool_call>call:get_weather{{city:{Q}Par"
    for cut, expected in [
        (head, {"city": "Par"}),
        (head + f"is{Q},when:{{days:[1,", {"city": "Paris", "when": {"days": [1]}}),
        (head + f"is{Q},days:", {"city": "Paris", "days": ""}),
        (head + f"is{Q},da", {"city": "Paris"}),
        (head + f"is{Q},n:4", {"city": "Paris", "n": 4}),
        (head[:-3] + "<|", {"city": "<|"}),  # a delimiter begun, not ended: its text
    ]:
        assert normal(parser(None, "gemma4").parse(cut))[2] == [("get_weather", expected)], cut


def test_gemma4_hostile_arguments_are_json_in_linear_time_and_never_raise():
    reply = parser("gemma4", "gemma4")
    events = reply.feed("<|channel>thought\nhm<|tool_call>call:add{a:")
    for _ in range(20_000):
        events += reply.feed("{b:[")  # 40,000 containers deep: written as text past the bound
    events += reply.feed(f"{Q}" + "}" * 10 + "garbage:" * 1000)
    parsed = joined(events + reply.finish())
    ((name, arguments),) = parsed.calls
    assert name == "add" and parsed.reasoning == "hm"
    value = json.loads(arguments)["a"]
    for _ in range(7):  # to the 16th container (the depth bound), the arguments' own first
        value = value["b"][0]
    assert isinstance(value["b"], str) and value["b"].startswith("[{b:[{b:[")
    after_end = f"<|tool_call>call:add{{a:1}}{Q}x{Q}}}<tool_call|>ok"  # text after its `}`
    assert parser(None, "gemma4").parse(after_end)[1:] == ("ok", [("add", '{"a": 1}')])
    reply = parser(None, "gemma4")
    events = reply.feed(f"<|tool_call>call:add{{a:{Q}")
    for _ in range(50_000):
        events += reply.feed("}<tool_call" + "<|")  # never the delimiter, never the end
    assert json.loads(joined(events + reply.finish()).calls[0][1])["a"].startswith("}<tool_call<|")


def test_every_parser_name_has_its_marker_texts():
    """A name without an entry failed each of its requests with a 500 (a KeyError in the
    pipeline), as a new parser's name did before its entry was added."""
    from conveyor.entrypoints import parsers

    assert set(parsers.REASONING_MARKERS) == set(parsers.REASONING_PARSERS)
    assert set(parsers.TOOL_MARKERS) == set(parsers.TOOL_CALL_PARSERS)
