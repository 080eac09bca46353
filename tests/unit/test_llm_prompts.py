"""The offline LLM as vLLM's: prompt dicts ({"prompt": text}, {"prompt_token_ids": ids}) are
taken as vLLM's docs write them, multi_modal_data is refused with a message that says why, and
LLM.chat reads each reply as the server does (reasoning apart from the answer, the family's
markers seen even when the tokenizer makes them special tokens)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_KWARGS
from tiny import MARKER_SPECIALS, make_scripted_checkpoint, thinking_script

from conveyor import LLM
from conveyor.sampling_params import SamplingParams
from conveyor.structured.params import StructuredOutputs

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llm")
    path = make_scripted_checkpoint(folder, thinking_script(), MARKER_SPECIALS)
    with LLM(str(path), dtype="float64", **DEVICE_KWARGS) as llm:
        yield llm


def test_prompt_dicts_generate_as_their_text_or_ids(llm):
    ids = llm.get_tokenizer().encode("Paris", add_special_tokens=False)
    plain = llm.generate(["Paris", ids], GREEDY, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Paris"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    (one,) = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == ids
    (embedded,) = llm.embed([{"prompt": "Paris"}], use_tqdm=False)
    assert embedded.prompt_token_ids == ids and embedded.finished
    assert embedded.outputs.hidden_size == llm.engine.model_config.hidden_size


def test_embed_answers_as_vllms_llm_embed(llm):
    """vLLM's shape: EmbeddingRequestOutput(request_id, outputs=EmbeddingOutput(embedding),
    prompt_token_ids, ...) per prompt, in order; PoolingParams(dimensions=...) checked against
    the model's hidden size, as vLLM checks it for a model not trained to shorten them."""
    from conveyor import EmbeddingRequestOutput, PoolingParams

    hidden = llm.engine.model_config.hidden_size
    outs = llm.embed(["Paris", "Rome is"], use_tqdm=False, pooling_params=PoolingParams())
    assert all(isinstance(out, EmbeddingRequestOutput) for out in outs)
    assert [out.prompt_token_ids for out in outs] == [
        llm.get_tokenizer().encode(p) for p in ("Paris", "Rome is")
    ]
    vectors = [torch.tensor(out.outputs.embedding, dtype=torch.float64) for out in outs]
    assert all(v.numel() == hidden and abs(float(v.norm()) - 1) < 1e-9 for v in vectors)
    assert not torch.equal(vectors[0], vectors[1]) and outs[0].request_id != outs[1].request_id
    same = llm.embed("Paris", use_tqdm=False, pooling_params=PoolingParams(dimensions=hidden))
    assert same[0].outputs.embedding == outs[0].outputs.embedding
    with pytest.raises(ValueError, match=f"have {hidden} dimensions and cannot be shortened"):
        llm.embed("Paris", use_tqdm=False, pooling_params=PoolingParams(dimensions=hidden - 1))
    with pytest.raises(ValueError, match="use_activation=False: conveyor's embeddings are"):
        llm.embed("Paris", use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    with pytest.raises(ValueError, match="tokenization_kwargs are not taken"):
        llm.embed("Paris", use_tqdm=False, tokenization_kwargs={"truncation": True})


@pytest.mark.parametrize(
    "prompt, words",
    [
        ({"prompt": "a", "multi_modal_data": {"image": None}}, "multi_modal_data"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        ({"text": "a"}, "exactly one"),
    ],
)
def test_a_prompt_dict_it_cannot_run_is_a_clear_value_error(llm, prompt, words):
    with pytest.raises(ValueError, match=words):
        llm.generate([prompt], GREEDY, use_tqdm=False)


def test_chat_reads_the_reply_as_the_server_does(llm):
    messages = [{"role": "user", "content": "Where?"}]
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False, reasoning_parser="mistral")
    parsed = out.outputs[0].parsed
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("ok", "Paris", [])
    (plain,) = llm.chat(messages, GREEDY, use_tqdm=False)  # no parser: the text as it was
    assert plain.outputs[0].parsed.reasoning is None
    with pytest.raises(ValueError, match="reasoning-parser"):
        llm.chat(messages, GREEDY, use_tqdm=False, reasoning_parser="nope")


def test_chat_matches_stop_strings_after_the_reasoning_only(llm):
    # "k" is written inside [THINK] o k [/THINK]: it ends the answer only, as on the server
    messages = [{"role": "user", "content": "Where?"}]
    for stop, content in (["k"], "Paris"), (["k", "ri"], "Pa"):
        params = SamplingParams(temperature=0, max_tokens=12, stop=stop)
        (out,) = llm.chat(messages, params, use_tqdm=False, reasoning_parser="mistral")
        parsed = out.outputs[0].parsed
        assert (parsed.reasoning, parsed.content) == ("ok", content)


def test_chat_structured_output_starts_after_the_reasoning(llm):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
    schema["additionalProperties"] = False
    params = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(json=schema)
    )
    messages = [{"role": "user", "content": "Where?"}]
    (out,) = llm.chat(messages, params, use_tqdm=False, reasoning_parser="mistral")
    parsed = out.outputs[0].parsed
    assert (parsed.reasoning, parsed.content) == ("ok", '{"city": "Paris"}')


def test_chat_thinking_token_budget_ends_the_reasoning(llm):
    messages = [{"role": "user", "content": "Where?"}]
    (out,) = llm.chat(
        messages, GREEDY, use_tqdm=False, reasoning_parser="mistral", thinking_token_budget=1
    )
    parsed = out.outputs[0].parsed
    assert (parsed.reasoning, parsed.content) == ("o", "Paris")
    with pytest.raises(ValueError, match="thinking_token_budget"):
        llm.chat(messages, GREEDY, use_tqdm=False, thinking_token_budget=1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
            llm.chat(
                messages, GREEDY, use_tqdm=False, reasoning_parser="mistral",
                thinking_token_budget=bad,
            )  # fmt: skip


def test_chat_takes_vllms_content_parts_and_continues_a_final_message(llm):
    """LLM.chat as vLLM's: text parts reach a string template one to a line (or as parts with
    chat_template_content_format="openai"), continue_final_message continues the last
    (assistant) message, both as transformers renders them; a part that is not text and a
    format it does not know are ValueErrors."""
    tokenizer = llm.get_tokenizer()

    def rendered(messages, **kwargs) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)

    parts = [{"type": "text", "text": "Where"}, {"type": "text", "text": "is it?"}]
    joined = [{"role": "user", "content": "Where\nis it?"}]
    prompt = llm.apply_chat_template([{"role": "user", "content": parts}])
    assert prompt == rendered(joined, add_generation_prompt=True)
    (out,) = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == prompt
    as_parts = llm.apply_chat_template(
        [{"role": "user", "content": parts}], content_format="openai"
    )
    assert as_parts == rendered([{"role": "user", "content": parts}], add_generation_prompt=True)
    follow = joined + [{"role": "assistant", "content": "It is in"}]
    (cont,) = llm.chat(
        follow, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert cont.prompt_token_ids == rendered(follow, continue_final_message=True)
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(joined, GREEDY, use_tqdm=False, chat_template_content_format="xml")
