"""Structured output in the engine (tiny checkpoints, float64): every output fits its
constraint whatever the model prefers, with or without speculative decoding; unconstrained
requests in the same batch are untouched; slow or bad grammars fail only their own request."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from conftest import DEVICE_KWARGS, random_prompts
from tiny import build_tokenizer, make_scripted_checkpoint, make_tiny_checkpoint, slow_schema

from conveyor import LLM, SamplingParams
from conveyor.engine.core import EngineCore
from conveyor.engine.core_io import CoreRequest
from conveyor.request import RequestStatus
from conveyor.structured import StructuredOutputs
from conveyor.structured.backend import strict_schema
from conveyor.structured.tools import parse_auto, parse_required, required_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "nick": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,5}"
CHOICES = ["yes", "no", "maybe so", "a.b|c (d)* [e]"]  # with regex metacharacters
CONSTRAINTS = [
    StructuredOutputs(json=PERSON),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICES),
    StructuredOutputs(json_object=True),
    StructuredOutputs(grammar='start: "x" ("+" "x")*  "=" /[0-9]/'),
]


def fits(constraint: StructuredOutputs, text: str) -> bool:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), constraint.json)
        return True
    if constraint.json_object:
        return isinstance(json.loads(text), dict)
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    return re.fullmatch(r"x(\+x)*=[0-9]", text) is not None


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A model whose greedy path is "zzzz...": every constraint here forbids it."""
    tokenizer = build_tokenizer()
    z = tokenizer.convert_tokens_to_ids("z")
    path = tmp_path_factory.mktemp("scripted-z")
    return make_scripted_checkpoint(path, {t: z for t in range(len(tokenizer))})


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft": "draft",  # the scripted model proposes, see below
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_every_output_fits_its_constraint_against_the_models_will(scripted, tiny, spec):
    config = SPECS[spec]
    if config == "draft":  # drafts of "z" the grammar always rejects
        config = {"method": "draft_model", "model": str(scripted), "num_speculative_tokens": 3}
    llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS, speculative_config=config, num_blocks=64)
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=150, structured_outputs=c)
        for c in CONSTRAINTS
        for i, temperature in enumerate((0.0, 1.0, 1.0))
    ]
    outs = llm.generate(["z z z z"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params, strict=True):
        completion = out.outputs[0]
        if p.structured_outputs.json_object and completion.finish_reason == "length":
            continue  # a random model's free-form keys may run on; no whitespace padding
        assert completion.finish_reason == "stop", (p.structured_outputs, completion)
        assert fits(p.structured_outputs, completion.text), completion.text


def test_a_model_that_wants_something_else_still_fits(scripted):
    llm = LLM(str(scripted), dtype="float64", **DEVICE_KWARGS)
    for constraint in CONSTRAINTS:
        params = SamplingParams(temperature=0, max_tokens=150, structured_outputs=constraint)
        completion = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
        assert not set(completion.text) <= {"z"}, completion.text
        if constraint.json_object or constraint.grammar:
            # Unbounded by the constraint ("zzz..." keys, "x+x+..."): cut by max_tokens.
            assert completion.finish_reason == "length"
            assert completion.text.startswith('{"' if constraint.json_object else "x+x")
            continue
        assert completion.finish_reason == "stop"
        assert fits(constraint, completion.text), completion.text


def test_greedy_constrained_output_is_the_same_with_speculative_decoding(tiny, scripted):
    prompts = ['{"name": "ab", "age": 3} {"name": "ab", "age": 3}', "x+x+x=1 x+x+x=1 x+"]
    texts = {}
    for name, config in [
        ("plain", None),
        ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}),
        ("draft", {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3}),
    ]:
        llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS, speculative_config=config)
        params = [
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=c)
            for c in (CONSTRAINTS[0], CONSTRAINTS[4])
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts[name] = [o.outputs[0].token_ids for o in outs]
        if config is not None:
            assert llm.engine.get_stats().spec.num_draft_tokens > 0
    assert texts["ngram"] == texts["plain"]
    assert texts["draft"] == texts["plain"]


def test_unconstrained_requests_in_the_batch_are_unchanged(tiny):
    llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS)
    prompts = random_prompts(6, 384, seed=3, max_len=30)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed_params = []
    for i in range(len(prompts)):
        mixed_params.append(free)
        mixed_params.append(
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=24, structured_outputs=CONSTRAINTS[i % 5]
            )
        )
    mixed_prompts = [p for p in prompts for _ in range(2)]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == alone


def test_padded_vocabulary_is_never_sampled(tmp_path):
    """A model with 512 logits over a 384-token tokenizer: the padding is never allowed."""
    path = make_tiny_checkpoint(tmp_path / "padded", vocab_size=512)
    llm = LLM(str(path), dtype="float64", **DEVICE_KWARGS)
    assert llm.engine.model_config.vocab_size == 512
    params = SamplingParams(
        temperature=2.0, seed=0, n=8, max_tokens=30, structured_outputs={"json_object": True}
    )
    for completion in llm.generate(["hi"], params, use_tqdm=False)[0].outputs:
        assert max(completion.token_ids) < 384
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_grammar_wins_over_min_tokens_and_ignore_eos(scripted):
    llm = LLM(str(scripted), dtype="float64", **DEVICE_KWARGS)
    params = SamplingParams(
        temperature=0,
        max_tokens=30,
        min_tokens=10,
        ignore_eos=True,
        structured_outputs={"choice": ["yes"]},
    )
    completion = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert (completion.text, completion.finish_reason) == ("yes", "stop")


def test_a_grammar_complete_at_max_tokens_is_a_stop(scripted):
    llm = LLM(str(scripted), dtype="float64", **DEVICE_KWARGS)
    tokens = build_tokenizer()("yes").input_ids
    params = SamplingParams(
        temperature=0, max_tokens=len(tokens), structured_outputs={"choice": ["yes"]}
    )
    completion = llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0]
    assert (completion.text, completion.finish_reason) == ("yes", "stop")


def test_constrained_requests_survive_preemption(tiny):
    llm = LLM(
        str(tiny), dtype="float64", **DEVICE_KWARGS, num_blocks=12, block_size=4, max_num_seqs=8
    )
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=CONSTRAINTS[0])
        for i in range(6)
    ]
    outs = llm.generate(["z z"] * 6, params, use_tqdm=False)
    assert llm.engine.get_stats().scheduler.num_preemptions_total > 0
    for out in outs:
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            assert fits(CONSTRAINTS[0], completion.text)


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"json": {"type": "foo"}}, ["structured_outputs.json", "Invalid type"]),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, ["Unsatisfiable"]),
        ({"regex": "a(b"}, ["structured_outputs.regex", "unclosed group"]),
        ({"grammar": "start: foo"}, ["structured_outputs.grammar", "foo"]),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_value_error(tiny, constraint, words):
    llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS)
    with pytest.raises(ValueError) as error:
        llm.generate(["hi"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    for word in words:
        assert word in str(error.value)
    assert not llm.engine.has_unfinished_requests()
    ok = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]})
    assert llm.generate(["hi"], ok, use_tqdm=False)[0].outputs[0].text in ("a", "b")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"jsn": {}}, "unknown field"),
        ({"regex": ""}, "non-empty string"),
        ("json", "must be a mapping"),
    ],
)
def test_malformed_structured_outputs_are_value_errors(value, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(structured_outputs=value)


def test_a_slow_grammar_waits_on_its_own_while_the_batch_runs(tiny):
    core = EngineCore(str(tiny), dtype="float64", **DEVICE_KWARGS)
    slow = SamplingParams(max_tokens=5, structured_outputs={"json": slow_schema()})
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    core.add_requests(
        [
            CoreRequest("slow", [5, 6, 7], slow, 5, 0, time.monotonic()),
            CoreRequest("free", [5, 6, 7], free, 30, 0, time.monotonic()),
        ]
    )
    finished: dict[str, float] = {}
    first_slow_token = None
    while core.has_unfinished_requests():
        for out in core.step():
            if out.request_id == "slow" and out.new_token_ids and first_slow_token is None:
                first_slow_token = time.monotonic()
            if out.status.finished:
                finished[out.request_id] = time.monotonic()
                assert out.error is None, out.error
    # The free request ran all its 30 steps while the grammar compiled.
    assert finished["free"] < first_slow_token
    assert core.get_stats().num_steps >= 30


def test_a_grammar_past_the_time_limit_fails_its_request_only(tiny):
    core = EngineCore(str(tiny), dtype="float64", **DEVICE_KWARGS, grammar_compile_timeout=0.05)
    slow = SamplingParams(max_tokens=5, structured_outputs={"json": slow_schema()})
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    core.add_requests(
        [
            CoreRequest("slow", [5, 6], slow, 5, 0, time.monotonic()),
            CoreRequest("free", [5, 6], free, 8, 0, time.monotonic()),
        ]
    )
    ends = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.status.finished:
                ends[out.request_id] = out
    assert ends["slow"].status == RequestStatus.FINISHED_ERROR
    assert "did not compile within 0.05 s" in ends["slow"].error
    assert ends["free"].status == RequestStatus.FINISHED_LENGTH

    # The front end applies the same limit: a ValueError before anything is admitted.
    llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS, grammar_compile_timeout=0.05)
    with pytest.raises(ValueError, match="did not compile within"):
        llm.generate(["hi"], slow, use_tqdm=False)


def test_a_bad_grammar_that_reaches_the_core_fails_with_its_error(tiny):
    core = EngineCore(str(tiny), dtype="float64", **DEVICE_KWARGS)
    bad = SamplingParams(max_tokens=5, structured_outputs={"regex": "a(b"})
    core.add_requests([CoreRequest("bad", [5], bad, 5, 0, time.monotonic())])
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [o.status for o in outs] == [RequestStatus.FINISHED_ERROR]
    assert "unclosed group" in outs[0].error


def test_aborting_a_request_that_waits_for_its_grammar(tiny):
    core = EngineCore(str(tiny), dtype="float64", **DEVICE_KWARGS)
    slow = SamplingParams(max_tokens=5, structured_outputs={"json": slow_schema(num_fields=2000)})
    core.add_requests([CoreRequest("slow", [5], slow, 5, 0, time.monotonic())])
    assert core.has_unfinished_requests()
    core.finish_requests(["slow"])
    assert not core.has_unfinished_requests()
    assert core.step() == []


def test_compiled_grammars_are_cached_by_constraint(tiny):
    llm = LLM(str(tiny), dtype="float64", **DEVICE_KWARGS)
    compiler = llm.engine.inputs.grammars
    assert compiler is llm.engine.core.grammars  # in-process: one compile per constraint
    params = SamplingParams(n=3, max_tokens=10, structured_outputs={"json": PERSON})
    llm.generate(["a", "b"], params, use_tqdm=False)
    queries, hits, seconds = compiler.take_stats()
    assert len(seconds) == 1  # compiled once, for 2 prompts x 3 completions
    assert hits == queries - 1


# ---- tools and schemas (pure functions) --------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"$ref": "#/$defs/city"}},
                "required": ["city"],
                "$defs": {"city": {"type": "string"}},
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_the_required_schema_accepts_calls_of_declared_tools_only():
    schema = required_schema(TOOLS)
    assert "$defs" in schema and "$defs" not in schema["items"]["anyOf"][0]["properties"]
    good = [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "now", "arguments": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_weather", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    clash = [dict(TOOLS[0]), {"type": "function", "function": dict(TOOLS[0]["function"], name="b")}]
    clash[1]["function"]["parameters"] = {"$defs": {"city": {"type": "integer"}}}
    with pytest.raises(ValueError, match="defined differently"):
        required_schema(clash)


def test_tool_calls_are_found_in_free_text():
    names = {"get_weather", "now"}
    content, calls = parse_auto('{"name": "get_weather", "arguments": {"city": "Oslo"}}', names)
    assert content is None and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = parse_auto(
        'Sure.\n<tool_call>\n{"name": "now", "parameters": {}}\n</tool_call>', names
    )
    assert content == "Sure." and calls[0].name == "now"
    assert parse_auto('{"name": "other", "arguments": {}}', names) == (
        '{"name": "other", "arguments": {}}',
        [],
    )
    assert parse_auto("Paris is the capital.", names) == ("Paris is the capital.", [])
    assert parse_required('[{"name": "now", "arguments": {}}]')[0].arguments == "{}"
    assert parse_required('[{"name": "now", "argu') == []  # cut inside its only call


def test_strict_schemas_close_every_object():
    schema = strict_schema(
        {
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
            "$defs": {"c": {"type": "object", "properties": {}}},
            "anyOf": [{"properties": {"d": {}}}],
        }
    )
    assert schema["additionalProperties"] is False
    assert schema["properties"]["a"]["additionalProperties"] is False
    assert schema["$defs"]["c"]["additionalProperties"] is False
    assert schema["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["a"]["properties"]["b"]
