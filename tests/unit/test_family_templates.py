"""Chat templates in the style of the new families render in the template environment conveyor
renders with (transformers' sandbox): Gemma's (a 'model' role, a system prompt folded into the
first user turn, raise_exception on roles that do not alternate, `| trim`), SmolLM3's and
Granite's (strftime_now, namespace(), tools through `| tojson`), Phi-3's and OLMo 2's plain
turns. A template's own refusal is a ValueError that says what it refused, never a crash."""

from __future__ import annotations

import json
import time

import pytest
from tiny import make_tiny_checkpoint

from conveyor import LLM

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
DATED_TOOLS = (  # SmolLM3 / Granite 3: today's date, a namespace, the tools as JSON
    "{%- set ns = namespace(system='Knowledge cutoff: June 2025. Today: ' + "
    "strftime_now('%Y') + '.') -%}"
    "{%- if tools -%}{%- set ns.system = ns.system + ' Tools: ' + (tools | tojson) -%}"
    "{%- endif -%}<|im_start|>system\n{{ ns.system }}<|im_end|>\n"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = (  # Phi-3 / OLMo 2: a tag per role, an end marker per turn
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3")
    with LLM(str(path), dtype="float32") as llm:
        yield llm


def text(llm: LLM, messages, template: str, **kwargs) -> str:
    ids = llm.apply_chat_template(messages, chat_template=template, **kwargs)
    return llm.engine.tokenizer.decode(ids)


def test_a_gemma_template_folds_the_system_prompt_and_names_the_model_turn(llm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why?"},
    ]
    rendered = text(llm, messages, GEMMA)
    assert rendered.endswith(
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello."
        "<end_of_turn>\n<start_of_turn>user\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_templates_own_refusal_is_a_value_error_that_says_why(llm):
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        text(llm, messages, GEMMA)
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_dated_templates_with_tools_render_today_and_the_tools(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    rendered = text(llm, [{"role": "user", "content": "Rain?"}], DATED_TOOLS, tools=tools)
    assert f"Today: {time.strftime('%Y')}." in rendered
    assert json.dumps(tools[0]["function"]["name"]) in rendered
    assert rendered.endswith("<|im_start|>user\nRain?<|im_end|><|im_start|>assistant\n")


def test_plain_role_tag_templates_render_each_turn(llm):
    messages = [{"role": "user", "content": "2+2?"}]
    assert text(llm, messages, PLAIN).endswith("<|user|>\n2+2?<|end|>\n<|assistant|>\n")
