"""Forced calls' grammars in each family's syntax (parsers/tools/forced.py): the family's own
text of one or two calls fits the grammar (llguidance, on a tokenizer whose markers are
special tokens), and the family's parser reads it back as those calls; another family's text
does not fit."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from tiny import MARKER_SPECIALS, build_tokenizer

from conveyor.entrypoints.parsers.events import joined
from conveyor.entrypoints.parsers.tools import tool_parser
from conveyor.entrypoints.parsers.tools.forced import (
    FORCED_FAMILIES,
    forced_grammar,
    harmony_final,
    lark_marker,
)
from conveyor.structured.params import StructuredOutputs

SPECIALS = (*MARKER_SPECIALS, "<|tool_call|>", "<|tool_call>", "<tool_call|>", '<|"|>')
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
CALLS = [{"city": "Paris"}, {"city": "Rome"}]


def text_of(family: str, calls: list[dict]) -> str:
    def obj(arguments, key="arguments"):
        return json.dumps({"name": "get_weather", key: arguments})

    if family == "hermes":
        return "\n".join(f"<tool_call>\n{obj(a)}\n</tool_call>" for a in calls)
    if family == "llama3_json":
        return "; ".join(obj(a, "parameters") for a in calls)
    if family in ("pythonic", "llama4_pythonic"):
        return "[" + ", ".join(_python_call(a) for a in calls) + "]"
    if family in ("qwen3_coder", "qwen3_xml"):
        return "\n".join(_xml_call(a) for a in calls)
    if family == "openai":
        one = (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>"
        )
        return "<|start|>assistant".join(one.format(json.dumps(a)) for a in calls)
    if family == "gemma4":
        return "".join(_gemma4_call(a) for a in calls)
    if family == "deepseek_v3":
        one = "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        body = "".join(one.format(json.dumps(a)) for a in calls)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    listed = "[" + ", ".join(obj(a) for a in calls) + "]"
    return {"mistral": "[TOOL_CALLS]", "granite": "<|tool_call|>"}[family] + listed


def _python_call(arguments: dict, name: str = "get_weather") -> str:
    keywords = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in arguments.items())
    return f"{name}({keywords})"


def _xml_call(arguments: dict, name: str = "get_weather") -> str:
    def value(v):
        return v if isinstance(v, str) else json.dumps(v)

    parameters = "".join(
        f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def _gemma4_call(arguments: dict, name: str = "get_weather") -> str:
    """A Gemma 4 call, its keys in the order given (the template sorts them)."""

    def value(v):
        if isinstance(v, str):
            return f'<|"|>{v}<|"|>'
        if isinstance(v, dict):
            return "{" + ",".join(f"{k}:{value(x)}" for k, x in v.items()) + "}"
        return {True: "true", False: "false"}.get(v, v) if isinstance(v, bool) else str(v)

    return f"<|tool_call>call:{name}{value(arguments)}<tool_call|>"


# Families that write the same text (one parser under two names).
TWINS = {"pythonic": "llama4_pythonic", "qwen3_coder": "qwen3_xml"}
TWINS |= {b: a for a, b in TWINS.items()}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    return tokenizer


def special_marker(tokenizer):
    """A marker as the grammar's terminal: the special token where the tokenizer has one."""

    def marker(text):
        special = text in SPECIALS
        return lark_marker(text, tokenizer.convert_tokens_to_ids(text) if special else None)

    return marker


def fits(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer), llguidance.grammar_from("grammar", grammar)
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and (matcher.is_accepting())
    )


@pytest.mark.parametrize("family", sorted(FORCED_FAMILIES))
def test_the_familys_own_calls_fit_its_grammar_and_read_back(tokenizer, family):
    def marker(text):
        special = text in SPECIALS
        return lark_marker(text, tokenizer.convert_tokens_to_ids(text) if special else None)

    several = forced_grammar(family, TOOLS, True, marker)
    one = forced_grammar(family, TOOLS, False, marker)
    for calls in (CALLS[:1], CALLS):
        text = text_of(family, calls)
        assert fits(tokenizer, several, text)
        assert fits(tokenizer, one, text) == (len(calls) == 1)
        parser = tool_parser(family, {"get_weather": PARAMETERS}, 16)
        parsed = joined(parser.feed(text) + parser.finish())
        assert [(n, json.loads(a)) for n, a in parsed.calls] == [("get_weather", c) for c in calls]
    others = sorted(FORCED_FAMILIES - {family, TWINS.get(family)})
    assert not any(fits(tokenizer, several, text_of(other, CALLS)) for other in others)


TYPED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "unit": {"enum": ["C", "F"]},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    },
    "required": ["city", "days"],
}


@pytest.mark.parametrize("family", ["pythonic", "qwen3_coder", "gemma4"])
def test_typed_arguments_are_written_in_schema_order_required_ones_always(tokenizer, family):
    """Gemma 4's order is its template's, sorted (TYPED's properties are listed sorted)."""
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": TYPED}}]
    grammar = forced_grammar(family, tools, False, special_marker(tokenizer))
    call = {"pythonic": _python_call, "qwen3_coder": _xml_call, "gemma4": _gemma4_call}[family]

    def text(arguments: dict) -> str:
        one = call(arguments, "forecast")
        return f"[{one}]" if family == "pythonic" else one

    full = {"city": "Oslo", "days": 3, "metric": True, "unit": "C", "where": {"lat": 59.9}}
    for arguments in (full, {"city": "Oslo", "days": 3}, {"city": "Oslo", "days": 3, "unit": "F"}):
        assert fits(tokenizer, grammar, text(arguments)), arguments
        parser = tool_parser(family, {"forecast": TYPED}, 16)
        parsed = joined(parser.feed(text(arguments)) + parser.finish())
        assert [(n, json.loads(a)) for n, a in parsed.calls] == [("forecast", arguments)]
    refused = [
        {"city": "Oslo"},  # a required argument missing
        {"days": 3, "city": "Oslo"},  # out of the schema's order
        {"city": "Oslo", "days": "three"},  # a string for an integer
        {"city": "Oslo", "days": 3, "unit": "K"},  # not in the enum
        {"city": "Oslo", "days": 3.5},  # a number for an integer
    ]
    for arguments in refused:
        assert not fits(tokenizer, grammar, text(arguments)), arguments


def test_a_name_the_syntax_cannot_write_is_refused():
    tool = {"type": "function", "function": {"name": "get-weather", "parameters": PARAMETERS}}
    with pytest.raises(ValueError, match="tools"):
        forced_grammar("pythonic", [tool], True, json.dumps)


@pytest.mark.parametrize("value", ["a < b", "<b>bold</b>\n<i>", "x</param", "if a<b:\n  c()"])
def test_a_qwen3_coder_string_argument_may_hold_markup(tokenizer, value):
    grammar = forced_grammar("qwen3_coder", TOOLS, False, lambda text: json.dumps(text))
    text = _xml_call({"city": value})
    assert fits(tokenizer, grammar, text)
    parser = tool_parser("qwen3_coder", {"get_weather": PARAMETERS}, 16)
    parsed = joined(parser.feed(text) + parser.finish())
    assert [(n, json.loads(a)) for n, a in parsed.calls] == [("get_weather", {"city": value})]


@pytest.mark.parametrize("tag", ["</parameter>", "</function>", "</tool_call>"])
def test_a_qwen3_coder_string_argument_cannot_hold_a_closing_tag(tokenizer, tag):
    grammar = forced_grammar("qwen3_coder", TOOLS, False, lambda text: json.dumps(text))
    assert not fits(tokenizer, grammar, _xml_call({"city": f"Paris{tag}Rome"}))


@pytest.mark.parametrize(
    "constraint, good, bad",
    [
        (StructuredOutputs(json=PARAMETERS), '{"city": "Paris"}', '{"town": "Paris"}'),
        (StructuredOutputs(json_object=True), '{"a": 1}', "[1]"),
        (StructuredOutputs(regex="a/b|c+"), "a/b", "a/bc"),
        (StructuredOutputs(choice=["yes/no", "maybe"]), "yes/no", "yes"),
    ],
)
def test_an_answers_grammar_is_written_in_harmonys_final_channel(tokenizer, constraint, good, bad):
    def marker(text):
        special = text in SPECIALS
        return lark_marker(text, tokenizer.convert_tokens_to_ids(text) if special else None)

    grammar = harmony_final(constraint, marker)
    assert fits(tokenizer, grammar, "<|channel|>final<|message|>" + good)
    assert not fits(tokenizer, grammar, "<|channel|>final<|message|>" + bad)
    assert not fits(tokenizer, grammar, good)  # the header is the answer's start


@pytest.mark.parametrize("value", ["a < b", "x}<tool_call", "{not: a, key}", 'say "hi"\n'])
def test_a_gemma4_string_argument_is_any_text_but_its_delimiter(tokenizer, value):
    grammar = forced_grammar("gemma4", TOOLS, False, special_marker(tokenizer))
    text = _gemma4_call({"city": value})
    assert fits(tokenizer, grammar, text)
    parser = tool_parser("gemma4", {"get_weather": PARAMETERS}, 16)
    parsed = joined(parser.feed(text) + parser.finish())
    assert [(n, json.loads(a)) for n, a in parsed.calls] == [("get_weather", {"city": value})]
    for marker in ('<|"|>', "<tool_call|>", "<channel|>"):  # would end the string or call
        assert not fits(tokenizer, grammar, _gemma4_call({"city": f"Paris{marker}Rome"}))
        plain = forced_grammar("gemma4", TOOLS, False, json.dumps)  # the markers as text
        assert not fits(build_tokenizer(), plain, _gemma4_call({"city": f"Paris{marker}Rome"}))
