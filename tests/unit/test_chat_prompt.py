"""A chat prompt is the template's text, bounded, then tokenized: what a request or a caller
gives as template variables never reaches a parameter of transformers' apply_chat_template or
of the tokenizer, and the ids are those transformers' tokenize=True gives."""

from __future__ import annotations

import inspect

import pytest
from conftest import DEVICE_KWARGS
from transformers import PreTrainedTokenizerBase

from conveyor import LLM
from conveyor.engine.input_processor import (
    TEMPLATE_CALLER_PARAMETERS,
    num_chars,
    reserved_template_variables,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with LLM(str(tiny_checkpoint("llama")), dtype="float64", **DEVICE_KWARGS) as llm:
        yield llm


def test_every_parameter_of_the_template_caller_and_the_tokenizer_is_reserved(llm):
    tokenizer = llm.get_tokenizer()
    reserved = reserved_template_variables(tokenizer)
    for cls in (PreTrainedTokenizerBase, type(tokenizer)):
        for method in ("apply_chat_template", "__call__", "encode"):
            parameters = inspect.signature(getattr(cls, method)).parameters.values()
            named = {p.name for p in parameters if p.kind != inspect.Parameter.VAR_KEYWORD}
            assert named <= reserved, (cls.__name__, method, named - reserved)
    assert TEMPLATE_CALLER_PARAMETERS <= reserved
    assert "enable_thinking" not in reserved and "reasoning_effort" not in reserved


def test_chat_ids_are_the_rendered_text_tokenized_as_transformers_does(llm):
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False, flag=True
    )
    got = llm.apply_chat_template(MESSAGES, chat_template_kwargs={"flag": True})
    assert got == list(expected)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(got) == text


@pytest.mark.parametrize(
    "kwargs",
    [
        {"padding": "max_length", "max_length": 100_000},
        {"return_tensors": "pt"},
        {"tokenizer_kwargs": {"padding": "max_length"}},
        {"truncation": True, "max_length": 2},
    ],
)
def test_chat_template_kwargs_cannot_set_a_parameter_of_the_caller(llm, kwargs):
    with pytest.raises(ValueError, match="cannot be set here") as refused:
        llm.apply_chat_template(MESSAGES, chat_template_kwargs=kwargs)
    assert sorted(kwargs)[0] in str(refused.value) and "/" not in str(refused.value)


def test_chat_text_is_bounded_before_it_is_rendered(llm):
    huge = [{"role": "user", "content": "x" * 10**6}]
    with pytest.raises(ValueError, match="messages: 10000.. characters cannot fit"):
        llm.apply_chat_template(huge)
    with pytest.raises(ValueError, match="chat_template_kwargs: .* characters cannot fit"):
        llm.apply_chat_template(MESSAGES, chat_template_kwargs={"notes": ["y"] * 10**5})


def test_num_chars_counts_keys_strings_and_one_for_each_other_value():
    assert num_chars({"ab": [1, None, "xyz", {"c": True}]}) == 2 + 1 + 1 + 3 + 1 + 1
    assert num_chars(["x" * 10] * 1000, stop_above=50) <= 60  # stops counting past the bound
