"""A checkpoint conveyor cannot compute exactly is refused at load with the setting's name,
never loaded and computed wrong: an unknown architecture (the error lists the families), a
RoPE that depends on the sequence length (dynamic NTK), partial rotary dims beside q/k norms,
another activation, biased MLPs, Gemma 3's bidirectional attention, biased Mamba2 projections
and a layer type Granite 4.0 does not have. A RoPE that changes past
a length (longrope, Ministral 3's query scale) serves within it, and past it as stated."""

from __future__ import annotations

import json

import pytest
from tiny import make_tiny_checkpoint
from transformers import AutoConfig

from conveyor.config import SUPPORTED_ARCHITECTURES
from conveyor.model.config import ModelConfig, rope_frequencies


def edited(path, **fields):
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_an_unknown_architecture_is_refused_with_the_supported_families(tmp_path):
    path = edited(make_tiny_checkpoint(tmp_path, "llama"), architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture") as error:
        ModelConfig.from_hf(str(path))
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_the_mixtures_of_experts_are_supported():
    names = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    for name in (*names, "GptOssForCausalLM"):
        assert name in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    ("family", "fields", "named"),
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0,
                                       "rope_theta": 10000.0}}, "rope_type 'dynamic'"),
        ("olmo2", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("granite4-h", {"mamba_proj_bias": True}, "mamba_proj_bias"),
        ("granitemoehybrid", {"layer_types": ["attention", "sliding_attention"]}, "layer_types"),
        ("nemotron_h-moe", {"moe_latent_size": 32}, "moe_latent_size"),
        ("nemotron_h", {"layers_block_type": ["mlp", "linear_attention"]}, "block 0 .'mlp'."),
        ("nemotron_h", {"sliding_window": 64}, "sliding_window"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("glm4_moe_lite", {"mlp_layer_types": ["sparse", "moe"]}, "mlp_layer_types"),
        ("gemma3n", {"attention_bias": True}, "attention_bias for gemma3n"),
        ("gemma3n", {"altup_active_idx": 3}, "altup_active_idx"),
    ],
    ids=["dynamic-rope", "activation", "mlp-bias", "bidirectional", "mamba-proj-bias",
         "granite-layer-type", "nemotron-latent-moe", "nemotron-mlp-first",
         "nemotron-window", "deepseek-v2-router", "deepseek-biased-latents",
         "glm-lite-mlp-type", "gemma3n-biased-attention", "gemma3n-active-stream"],
)  # fmt: skip
def test_a_setting_the_family_does_not_compute_is_refused_by_name(tmp_path, family, fields, named):
    path = edited(make_tiny_checkpoint(tmp_path, family), **fields)
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(str(path))


def test_longrope_serves_its_short_factors_by_default_and_its_long_ones_past_them(tmp_path):
    """Phi-3.5 / Phi-4-mini: transformers turns by the short factors while a sequence stays
    within original_max_position_embeddings, by the long ones past it. By default the context
    stops at that length (transformers' tokens for every prompt, checked in
    tests/equivalence/test_families.py); a longer max_model_len turns every position by the
    long factors (vLLM's and llama.cpp's choice), up to max_position_embeddings."""
    path = make_tiny_checkpoint(tmp_path, "phi3-longrope")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    config = ModelConfig.from_hf(str(path))
    assert config.max_model_len == 128 < limit
    hf = AutoConfig.from_pretrained(path)
    assert config.rope_inv_freq == rope_frequencies(hf, config.head_dim)[0]
    longer = ModelConfig.from_hf(str(path), max_model_len=129)
    assert longer.max_model_len == 129
    assert longer.rope_inv_freq == rope_frequencies(hf, config.head_dim, long=True)[0]
    assert longer.rope_inv_freq != config.rope_inv_freq
    assert longer.rope_scaling == config.rope_scaling
    with pytest.raises(ValueError, match=rf"\[1, {limit}\] \(the model's max_position_emb"):
        ModelConfig.from_hf(str(path), max_model_len=limit + 1)


def test_ministral3_is_served_below_its_query_scaling_and_refused_past_it(tmp_path):
    """Ministral 3 scales its queries by 1 + beta * log(1 + floor(position / original)): 1
    below original_max_position_embeddings, where conveyor computes it as transformers."""
    path = make_tiny_checkpoint(tmp_path, "ministral3")
    assert ModelConfig.from_hf(str(path)).max_model_len == 128
    with pytest.raises(
        ValueError, match=r"\[1, 128\] \(the queries' scale is 1 below position 128"
    ):
        ModelConfig.from_hf(str(path), max_model_len=129)


@pytest.mark.parametrize(
    ("family", "overrides", "reason"),
    [
        ("qwen3_moe", {}, "a mixture-of-experts"),
        # Arcee's MLP has no gate: the adapter slots (a gate and an up part) do not fit it
        ("arcee", {}, "an ungated MLP"),
        ("deepseek_v3", {"first_k_dense_replace": 2}, "multi-head latent attention"),
        ("gemma4", {}, "Gemma 4"),
        ("gemma3n", {}, "Gemma 3n"),
    ],
)
def test_lora_on_layers_without_adapter_slots_is_refused_by_name(
    tmp_path, family, overrides, reason
):
    from conveyor import LLM

    path = make_tiny_checkpoint(tmp_path, family, **overrides)
    with pytest.raises(ValueError, match=f"LoRA adapters on {reason}"):
        LLM(str(path), dtype="float32", enable_lora=True)
