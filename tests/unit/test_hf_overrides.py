"""vLLM's --hf-overrides: config.json fields replaced before the model is built, read by
transformers' config class as if the file said so (model/config.py hf_config). The oracle is
transformers itself, given the same overridden config and the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_matches_reference, hf_greedy, random_prompts
from transformers import AutoModelForCausalLM

from conveyor import LLM, SamplingParams
from conveyor.model.config import ModelConfig, hf_config

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_an_overridden_rope_and_context_equal_transformers_given_them(tiny_checkpoint):
    """The tiny llama made to run YaRN over 4x its context: tokens and logprobs as
    transformers computes them with the same overridden config (float64)."""
    folder = tiny_checkpoint("llama")
    overrides = {"rope_scaling": YARN, "max_position_embeddings": 256}
    config = hf_config(folder, overrides)
    assert config.rope_parameters["rope_type"] == "yarn" and config.max_position_embeddings == 256
    reference_model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float64
    )
    prompts = random_prompts(4, 300, seed=5, max_len=120)  # past the original 64 positions
    reference = hf_greedy(reference_model, prompts, 24)
    llm = LLM(str(folder), dtype="float64", hf_overrides=overrides)
    assert llm.engine.model_config.max_model_len == 256
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_reference(outputs, reference)
    plain = LLM(str(folder), dtype="float64").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outputs]


def test_fewer_layers_load_the_first_ones_and_the_config_is_kept_apart(tiny_checkpoint):
    """num_hidden_layers cut short (vLLM users' quick test of a big model): the checkpoint's
    later layers are left unread; the overridden facts are kept apart from the file's own."""
    folder = tiny_checkpoint("llama")
    cut = ModelConfig.from_hf(str(folder), "float64", hf_overrides={"num_hidden_layers": 1})
    whole = ModelConfig.from_hf(str(folder), "float64")
    assert (cut.num_layers, whole.num_layers) == (1, 2)
    config = hf_config(folder, {"num_hidden_layers": 1})
    reference_model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch.float64
    )
    prompts = random_prompts(3, 300, seed=2)
    llm = LLM(str(folder), dtype="float64", hf_overrides={"num_hidden_layers": 1})
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_matches_reference(outputs, hf_greedy(reference_model, prompts, 12))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_attention_heads": 7}, "not a multiple of the number of attention heads"),
        ({"model_type": "nonexistent"}, "Unrecognized model identifier"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_an_override_that_cannot_build_a_config_is_a_value_error(
    tiny_checkpoint, overrides, message
):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", hf_overrides=overrides)
